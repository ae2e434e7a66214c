// troupe sft: supervised fine-tuning on chat data (models/post/sft_data.hpp): a JSONL file of
// conversations rendered by a chat template, the loss on the assistant tokens only, several
// conversations packed per row (attention and positions kept per conversation), trained by the
// single-process trainer's step (models/post/sft_step.hpp) and saved in HF layout.
#include <fmt/core.h>

#include <memory>

#include "apps/commands.hpp"
#include "apps/post_run.hpp"
#include "models/post/sft_data.hpp"
#include "models/post/sft_step.hpp"

namespace troupe::apps {
namespace {

struct sft_cli : post_cli {
  bool pack = true;
};

int run_sft(const sft_cli& c) {
  post_setup s = prepare_post(c, "sft", 1);
  auto convs = models::read_chat_jsonl(c.data).value();
  const models::sft_options o{.format = s.format,
                              .seq = s.cfg.seq,
                              .pack = c.pack,
                              .truncate = c.truncate,
                              .pad_id = s.tok->eos_id() >= 0 ? s.tok->eos_id() : 0};
  auto rows = std::make_shared<const models::sft_rows>(
      models::make_sft_rows(*s.tok, s.specials, convs, o, c.data).value());
  auto model = make_post_model(s);
  models::trainer tr(*model, s.cfg);
  fmt::print("troupe sft: {} ({:.2f} M parameters), template {}, tokenizer {}\n", s.label,
             static_cast<double>(model->slots().param_count()) / 1e6, c.chat_template,
             s.tok->name());
  fmt::print("data: {}: {} conversations in {} rows of {} tokens ({}), {} assistant targets\n",
             c.data, rows->conversations, rows->rows(), rows->seq,
             c.pack ? "packed" : "one per row", rows->trained_targets);
  auto json = open_post_json(c.json_path);
  const auto micro = models::sft_micro_batch(rows, s.per_batch, s.cfg.grad_accum);
  models::train_hooks hooks;
  hooks.on_step = [&](const models::step_result& r) {
    if (json)
      fmt::print(json.get(), "{{\"step\": {}, \"loss\": {}, \"grad_norm\": {}, \"lr\": {:.6g}}}\n",
                 r.step, r.loss, r.grad_norm, r.lr);
    if (r.step % s.cfg.log_every == 0 || r.step == s.cfg.steps || r.step == 1)
      fmt::print("step {:5d}/{}  loss {:.4f}  grad norm {:.3f}  lr {:.2e}  {:.0f} tokens/s\n",
                 r.step, s.cfg.steps, r.loss, r.grad_norm, r.lr, r.tokens / r.seconds);
    std::fflush(stdout);
  };
  return run_post_loop(s, models::trainer_policy(tr, s.mcfg, micro), std::move(hooks),
                       "HF layout; troupe generate --model " + s.cfg.ckpt_dir);
}

}  // namespace

command_fn add_sft_command(CLI::App& app) {
  auto c = std::make_shared<sft_cli>();
  auto* sub = app.add_subcommand(
      "sft", "Supervised fine-tuning on chat JSONL: loss on assistant tokens, packed rows");
  add_post_flags(sub, *c, "Rows per micro-batch");
  sub->add_flag("--pack,!--no-pack", c->pack,
                "Pack several conversations per row (first-fit; --no-pack: one per row)");
  return [sub, c]() -> int {
    if (!sub->parsed()) return -1;
    return run_sft(*c);
  };
}

}  // namespace troupe::apps
