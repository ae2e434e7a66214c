// The one training loop (train_loop.hpp).
#include "models/train_loop.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <variant>

#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/text/token_file.hpp"

namespace troupe::models {

bool checkpoint_due(const train_config& cfg, std::int64_t step) {
  if (cfg.ckpt_dir.empty()) return false;
  return (cfg.ckpt_every > 0 && step % cfg.ckpt_every == 0) || step == cfg.steps;
}

train_progress run_train_loop(const train_config& cfg, std::int64_t first,
                              const train_policy& policy, const train_hooks& hooks) {
  TROUPE_CHECK(policy.step != nullptr, "run_train_loop: the policy has no step");
  TROUPE_CHECK(cfg.ckpt_dir.empty() || policy.save != nullptr, "run_train_loop: checkpoint.dir ",
               cfg.ckpt_dir, " is set but the policy cannot save");
  train_progress p;
  p.first = p.step = first;
  auto save = [&] {
    const auto held = hf::checkpoint_step(cfg.ckpt_dir);
    policy.save(cfg.ckpt_dir);
    p.saved = p.step;
    if (hooks.on_save) hooks.on_save(p.step, cfg.ckpt_dir, held);
  };
  while (p.step < cfg.steps) {
    if (hooks.stop && hooks.stop()) {
      p.stopped = true;
      if (!cfg.ckpt_dir.empty() && p.ran > 0 && p.saved != p.step) save();
      break;
    }
    step_result r;
    try {
      r = policy.step(p.step);
    } catch (...) {
      if (policy.failed) policy.failed(std::current_exception(), p);
      throw;
    }
    TROUPE_CHECK(r.step == p.step + 1, "run_train_loop: the step after ", p.step,
                 " steps reported step ", r.step);
    if (p.ran == 0) p.first_loss = r.loss;
    ++p.ran;
    p.step = r.step;
    p.last_loss = r.loss;
    p.seconds += r.seconds;
    p.tokens += r.tokens;
    if (hooks.on_step) hooks.on_step(r);
    if (checkpoint_due(cfg, r.step)) save();
  }
  return p;
}

std::string trained_line(const train_progress& p) {
  return fmt::format("trained to step {} in {:.1f} s ({:.0f} tokens/s); loss {:.3f} -> {:.3f}",
                     p.step, p.seconds, static_cast<double>(p.tokens) / std::max(p.seconds, 1e-9),
                     p.first_loss, p.last_loss);
}

namespace {

hf::model_config read_model_config(const train_config& cfg) {
  if (!cfg.resume.empty()) return hf::read_config(cfg.resume).value();
  if (!cfg.model_hf.empty()) return hf::read_config(cfg.model_hf).value();
  std::int64_t vocab = 0;
  if (!cfg.data_tokens.empty()) vocab = token_dataset::open(cfg.data_tokens).value().vocab_size();
  return named_model_config(cfg.model_size, vocab).value();
}

}  // namespace

hf::model_config model_config_of(const train_config& cfg) {
  hf::model_config m = read_model_config(cfg);
  if (cfg.moe_capacity_factor > 0) {
    auto* moe = std::get_if<hf::moe_config>(&m);
    TROUPE_CHECK(moe != nullptr, "model.moe_capacity_factor ", cfg.moe_capacity_factor,
                 ": the model '", model_label(cfg), "' has no experts (it is not an MoE model)");
    moe->capacity_factor = cfg.moe_capacity_factor;
  }
  if (cfg.moe_aux_loss_coef >= 0) {
    auto* moe = std::get_if<hf::moe_config>(&m);
    TROUPE_CHECK(moe != nullptr, "model.moe_aux_loss_coef (--moe-aux-loss-coef) ",
                 cfg.moe_aux_loss_coef, ": the model '", model_label(cfg),
                 "' has no experts (it is not an MoE model)");
    moe->router_aux_loss_coef = cfg.moe_aux_loss_coef;
    moe->output_router_logits = cfg.moe_aux_loss_coef > 0;
  }
  return m;
}

std::string model_label(const train_config& cfg) {
  if (!cfg.resume.empty()) return cfg.resume;
  return cfg.model_hf.empty() ? cfg.model_size : cfg.model_hf;
}

train_policy trainer_policy(trainer& tr, const hf::model_config& model,
                            const trainer::batch_source& data) {
  train_policy p;
  p.step = [&tr, &data](std::int64_t) { return tr.step(data); };
  p.save = [&tr, &model](const std::string& folder) { tr.save(folder, model).value(); };
  return p;
}

train_policy trainer_policy(trainer& tr, const hf::model_config& model,
                            const trainer::micro_batch& run) {
  train_policy p;
  p.step = [&tr, &run](std::int64_t) { return tr.step(run); };
  p.save = [&tr, &model](const std::string& folder) { tr.save(folder, model).value(); };
  return p;
}

}  // namespace troupe::models
