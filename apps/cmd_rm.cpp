// troupe rm: reward-model training (TRL's RewardTrainer): a scalar head on the trunk
// (models/post/reward_model.hpp) trained on preference pairs with the Bradley-Terry loss
// (models/post/reward_step.hpp), saved as an HF ...ForSequenceClassification folder.
#include <fmt/core.h>

#include <memory>

#include "apps/commands.hpp"
#include "apps/post_run.hpp"
#include "models/post/preference_data.hpp"
#include "models/post/reward_model.hpp"
#include "models/post/reward_step.hpp"

namespace troupe::apps {
namespace {

int run_rm(const post_cli& c) {
  post_setup s = prepare_post(c, "rm", 2);  // a pair is two rows
  const std::int32_t pad = s.tok->eos_id() >= 0 ? s.tok->eos_id() : 0;
  const models::preference_options po{
      .format = s.format, .seq = s.cfg.seq, .truncate = c.truncate, .pad_id = pad};
  auto rows = std::make_shared<const models::preference_rows>(
      models::read_preference_jsonl(c.data, *s.tok, s.specials, po).value());
  models::reward_model rm(s.mcfg, {s.cfg.batch, s.cfg.seq}, pad);
  rm.lm().init_weights(s.cfg.seed);
  if (!s.cfg.model_hf.empty())  // a reward model's folder, or a causal LM's (a new score)
    rm.load(s.cfg.model_hf, /*need_score=*/false).value();
  models::trainer tr(rm.lm(), s.cfg);
  fmt::print("troupe rm: {} with a score head, pad id {}\n", s.label, pad);
  fmt::print("data: {}: {} pairs, {} per micro-batch\n", c.data, rows->pairs(), s.per_batch);
  auto json = open_post_json(c.json_path);
  models::reward_result last;
  const auto micro = models::reward_micro_batch(rows, rm, s.per_batch,
                                                [&](const models::reward_result& r) { last = r; });
  models::train_policy policy;
  policy.step = [&](std::int64_t) { return tr.step(micro); };
  policy.save = [&](const std::string& folder) {
    models::hf::save_folder_atomically(folder, [&](const std::filesystem::path& dir) {
      return rm.save(dir);
    }).value();
  };
  models::train_hooks hooks;
  hooks.on_step = [&](const models::step_result& r) {
    if (json)
      fmt::print(json.get(),
                 "{{\"step\": {}, \"loss\": {}, \"grad_norm\": {}, \"lr\": {:.6g}, "
                 "\"accuracy\": {}}}\n",
                 r.step, r.loss, r.grad_norm, r.lr, last.accuracy);
    if (r.step % s.cfg.log_every == 0 || r.step == s.cfg.steps || r.step == 1)
      fmt::print("step {:5d}/{}  loss {:.4f}  accuracy {:.2f}  grad norm {:.3f}  lr {:.2e}\n",
                 r.step, s.cfg.steps, r.loss, last.accuracy, r.grad_norm, r.lr);
    std::fflush(stdout);
  };
  return run_post_loop(s, policy, std::move(hooks), "HF ...ForSequenceClassification layout");
}

}  // namespace

command_fn add_rm_command(CLI::App& app) {
  auto c = std::make_shared<post_cli>();
  auto* sub = app.add_subcommand(
      "rm", "Train a reward model (a score head) on preference pairs, Bradley-Terry loss");
  add_post_flags(sub, *c, "Pairs per micro-batch");
  return [sub, c]() -> int {
    if (!sub->parsed()) return -1;
    return run_rm(*c);
  };
}

}  // namespace troupe::apps
