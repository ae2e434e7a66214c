// troupe dpo: Direct Preference Optimization (models/post/dpo_step.hpp) on preference pairs
// (JSONL of {"prompt", "chosen", "rejected"}, as strings or as lists of messages with a chat
// template), against a frozen reference: a copy of the starting weights, run forward only in
// the same process. Sigmoid loss with label smoothing, or IPO; TRL's metrics in the log.
//
// Under troupe launch -n N with troupe train's plan flags it is one rank of a hybrid-parallel run
// (apps/post_launched.hpp): the reference's log-probabilities are precomputed on every rank and
// the trainers train on dpo_samples (models/post/plan_samples.hpp); its --json carries the step,
// loss, gradient norm and learning rate (not TRL's reward metrics).
#include <fmt/core.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "actors/bootstrap.hpp"
#include "actors/training.hpp"
#include "apps/commands.hpp"
#include "apps/plan_flags.hpp"
#include "apps/post_launched.hpp"
#include "apps/post_run.hpp"
#include "models/post/dpo_step.hpp"
#include "models/post/plan_samples.hpp"
#include "models/post/preference_data.hpp"
#include "tensor/ops.hpp"

namespace troupe::apps {
namespace {

struct dpo_cli : post_cli {
  double beta = 0.1, label_smoothing = 0.0;
  std::string loss = "sigmoid";
  plan_cli plan;  // --dp, --tp, ... (apps/plan_flags.hpp)
  config_flags plan_flags;
};

// One rank of a launched run (apps/post_launched.hpp): the reference's log-probabilities of every
// row are computed here, from the starting weights on a whole model (every rank the same), and
// the trainers train on dpo_samples (a microbatch must hold whole pairs: an even number of rows).
int run_dpo_launched(const dpo_cli& c, const post_setup& s,
                     std::shared_ptr<const models::preference_rows> rows,
                     const models::dpo_options& opt) {
  refuse_unlaunchable("dpo", s.cfg);
  const auto& plan = s.cfg.plan;
  const std::int64_t per_micro = s.cfg.batch / (plan.dp * plan.microbatches);
  TROUPE_CHECK(per_micro % 2 == 0, "troupe dpo: --batch ", s.per_batch, " pairs (", s.cfg.batch,
               " rows) over parallel.dp (--dp) ", plan.dp,
               " x parallel.microbatches (--microbatches) ", plan.microbatches, " gives ",
               per_micro,
               " rows per microbatch: a microbatch must hold whole pairs (an even number of rows)");
  post_setup pairs = {};
  pairs.cfg = s.cfg;
  pairs.mcfg = s.mcfg;
  pairs.cfg.batch = 2;  // the reference runs pair by pair (dpo_reference_logprobs)
  auto reference = make_post_model(pairs);
  auto logp = std::make_shared<const std::vector<double>>(
      models::dpo_reference_logprobs(*reference, *rows, opt));
  reference.reset();
  return run_post_launched(
      c, s, "dpo",
      fmt::format("data: {}: {} pairs, {} per micro-batch; loss {} beta {} label smoothing {}; "
                  "the reference is the starting weights",
                  c.data, rows->pairs(), s.per_batch, c.loss, c.beta, c.label_smoothing),
      actors::trainer_samples{.model = s.mcfg,
                              .make = [rows, logp, opt](const models::train_config&) {
                                return models::dpo_samples(rows, logp, opt);
                              }});
}

int run_dpo(const dpo_cli& c) {
  // A micro-batch of --batch pairs is 2 x --batch rows.
  post_setup s = prepare_post(c, "dpo", 2, &c.plan_flags);
  auto type = models::parse_dpo_loss_type(c.loss);
  if (!type) throw error("--loss: " + type.error_message());
  const models::dpo_options opt{
      .type = *type, .beta = c.beta, .label_smoothing = c.label_smoothing};
  TROUPE_CHECK(c.beta > 0, "--beta must be > 0, got ", c.beta);
  TROUPE_CHECK(c.label_smoothing >= 0 && c.label_smoothing < 0.5,
               "--label-smoothing must be in [0, 0.5), got ", c.label_smoothing);
  const models::preference_options po{.format = s.format,
                                      .seq = s.cfg.seq,
                                      .truncate = c.truncate,
                                      .pad_id = s.tok->eos_id() >= 0 ? s.tok->eos_id() : 0};
  auto rows = std::make_shared<const models::preference_rows>(
      models::read_preference_jsonl(c.data, *s.tok, s.specials, po).value());
  if (actors::join_info_from_env().has_value()) return run_dpo_launched(c, s, rows, opt);
  refuse_plan_in_one_process("dpo", s.cfg);
  auto policy = make_post_model(s);
  auto reference = models::make_causal_lm(s.mcfg, {s.cfg.batch, s.cfg.seq}, post_dtype(s));
  ops::copy(policy->memory().params(), reference->memory().params());  // frozen: never stepped
  models::trainer tr(*policy, s.cfg);
  fmt::print("troupe dpo: {} ({:.2f} M parameters), loss {} beta {} label smoothing {}\n", s.label,
             static_cast<double>(policy->slots().param_count()) / 1e6, c.loss, c.beta,
             c.label_smoothing);
  fmt::print("data: {}: {} pairs, {} per micro-batch; the reference is the starting weights\n",
             c.data, rows->pairs(), s.per_batch);
  auto json = open_post_json(c.json_path);
  models::dpo_result last;
  const auto micro = models::dpo_micro_batch(rows, *reference, s.per_batch, opt,
                                             [&](const models::dpo_result& r) { last = r; });
  models::train_hooks hooks;
  hooks.on_step = [&](const models::step_result& r) {
    if (json)
      fmt::print(json.get(),
                 "{{\"step\": {}, \"loss\": {}, \"grad_norm\": {}, \"lr\": {:.6g}, "
                 "\"rewards/chosen\": {}, \"rewards/rejected\": {}, \"rewards/accuracies\": {}, "
                 "\"rewards/margins\": {}}}\n",
                 r.step, r.loss, r.grad_norm, r.lr, last.rewards_chosen, last.rewards_rejected,
                 last.accuracy, last.margin);
    if (r.step % s.cfg.log_every == 0 || r.step == s.cfg.steps || r.step == 1)
      fmt::print(
          "step {:5d}/{}  loss {:.4f}  rewards/chosen {:.3f}  rewards/rejected {:.3f}  "
          "accuracy {:.2f}  margin {:.3f}  grad norm {:.3f}\n",
          r.step, s.cfg.steps, r.loss, last.rewards_chosen, last.rewards_rejected, last.accuracy,
          last.margin, r.grad_norm);
    std::fflush(stdout);
  };
  return run_post_loop(s, models::trainer_policy(tr, s.mcfg, micro), std::move(hooks),
                       "HF layout; troupe generate --model " + s.cfg.ckpt_dir);
}

}  // namespace

command_fn add_dpo_command(CLI::App& app) {
  auto c = std::make_shared<dpo_cli>();
  auto* sub = app.add_subcommand(
      "dpo", "Direct Preference Optimization on preference pairs against a frozen reference");
  add_post_flags(sub, *c, "Pairs per micro-batch");
  sub->add_option("--beta", c->beta, "DPO beta")->capture_default_str();
  sub->add_option("--loss", c->loss, "sigmoid or ipo")->capture_default_str();
  sub->add_option("--label-smoothing", c->label_smoothing, "Conservative DPO (sigmoid only)")
      ->capture_default_str();
  add_plan_flags(sub, c->plan, c->plan_flags);
  return [sub, c]() -> int {
    if (!sub->parsed()) return -1;
    return run_dpo(*c);
  };
}

}  // namespace troupe::apps
