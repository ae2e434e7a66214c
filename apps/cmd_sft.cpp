// troupe sft: supervised fine-tuning on chat data (models/post/sft_data.hpp): a JSONL file of
// conversations rendered by a chat template, the loss on the assistant tokens only, several
// conversations packed per row (attention and positions kept per conversation), trained by the
// single-process trainer's step (models/post/sft_step.hpp) and saved in HF layout.
//
// Under troupe launch -n N with troupe train's plan flags (--dp, --tp, --pp, --zero, ...) it is
// one rank of a hybrid-parallel run: rank 0 drives the trainer actors of every rank
// (actors/training.hpp), each of which reads the same JSONL file into the same rows and trains
// its piece on them (models/post/plan_samples.hpp: sft_samples); the checkpoint is the plan
// checkpoint path's HF folder; packed rows run under every dp x tp x pp plan (each tensor shard
// and pipeline stage attends within a row's conversations). --cp, --ep and elastic runs are
// refused by name.
#include <fmt/core.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "actors/bootstrap.hpp"
#include "actors/training.hpp"
#include "apps/commands.hpp"
#include "apps/plan_flags.hpp"
#include "apps/post_launched.hpp"
#include "apps/post_run.hpp"
#include "models/post/plan_samples.hpp"
#include "models/post/sft_data.hpp"
#include "models/post/sft_step.hpp"

namespace troupe::apps {
namespace {

struct sft_cli : post_cli {
  bool pack = true;
  plan_cli plan;  // --dp, --tp, ... (apps/plan_flags.hpp)
  config_flags plan_flags;
};

// The run's rows: a pure function of the file and the settings (every rank makes the same).
std::shared_ptr<const models::sft_rows> sft_rows_of(const sft_cli& c, const post_setup& s) {
  auto convs = models::read_chat_jsonl(c.data).value();
  const models::sft_options o{.format = s.format,
                              .seq = s.cfg.seq,
                              .pack = c.pack,
                              .truncate = c.truncate,
                              .pad_id = s.tok->eos_id() >= 0 ? s.tok->eos_id() : 0};
  return std::make_shared<const models::sft_rows>(
      models::make_sft_rows(*s.tok, s.specials, convs, o, c.data).value());
}

std::string data_line(const sft_cli& c, const models::sft_rows& rows) {
  return fmt::format(
      "data: {}: {} conversations in {} rows of {} tokens ({}), {} assistant targets", c.data,
      rows.conversations, rows.rows(), rows.seq, c.pack ? "packed" : "one per row",
      rows.trained_targets);
}

// One rank of a launched run (apps/post_launched.hpp).
int run_sft_launched(const sft_cli& c, const post_setup& s) {
  refuse_unlaunchable("sft", s.cfg);
  auto rows = sft_rows_of(c, s);
  const bool pack = c.pack;
  return run_post_launched(
      c, s, "sft", data_line(c, *rows),
      actors::trainer_samples{.model = s.mcfg,
                              .make = [rows, pack](const models::train_config& cfg) {
                                return models::sft_samples(rows, cfg.batch, cfg.grad_accum, pack);
                              }});
}

int run_sft(const sft_cli& c) {
  post_setup s = prepare_post(c, "sft", 1, &c.plan_flags);
  if (actors::join_info_from_env().has_value()) return run_sft_launched(c, s);
  refuse_plan_in_one_process("sft", s.cfg);
  auto rows = sft_rows_of(c, s);
  auto model = make_post_model(s);
  models::trainer tr(*model, s.cfg);
  fmt::print("troupe sft: {} ({:.2f} M parameters), template {}, tokenizer {}\n", s.label,
             static_cast<double>(model->slots().param_count()) / 1e6, c.chat_template,
             s.tok->name());
  fmt::print("{}\n", data_line(c, *rows));
  auto json = open_post_json(c.json_path);
  const auto micro = models::sft_micro_batch(rows, s.per_batch, s.cfg.grad_accum);
  models::train_hooks hooks;
  hooks.on_step = [&](const models::step_result& r) {
    print_json_step(json.get(), r);
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
  add_plan_flags(sub, c->plan, c->plan_flags);
  return [sub, c]() -> int {
    if (!sub->parsed()) return -1;
    return run_sft(*c);
  };
}

}  // namespace troupe::apps
