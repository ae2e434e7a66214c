// rl_model: what the RL role actors (GRPO: grpo_roles.hpp, PPO: ppo_roles.hpp) share: a model
// built from an HF checkpoint folder for a planned batch, the trainer of a policy or critic, and
// the versioned push of a policy's flat weights to rollout actors over the data plane.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "actors/grpo_roles.hpp"
#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/hf/config.hpp"
#include "models/trainer.hpp"

namespace troupe::actors {

// The name of the tensor message carrying version N of a policy's weights: "grpo-weights vN".
inline constexpr std::string_view rl_weights_prefix = "grpo-weights v";

struct rl_built_model {
  models::hf::model_config cfg;
  std::unique_ptr<models::causal_lm> model;
};

// The model of s.checkpoint's config.json, planned for rows x seq; with its weights when `load`
// is set. Errors name `who`.
rl_built_model build_rl_model(const grpo_model_setup& s, bool load, const std::string& who);

// AdamW at a constant rate after `warmup` steps, for batches of rows x seq.
models::train_config rl_train_config(const grpo_model_setup& m, double lr, double weight_decay,
                                     double clip, double beta1, double beta2, std::int64_t warmup);

// Sends `params` (a policy's flat weights) to the rollout actors `to` as version `version` and
// waits until they hold them.
grpo_push_reply push_rl_weights(role_context& c, const tensor& params, std::int64_t version,
                                const std::vector<role_handle>& to);

// The save and push handlers of a policy trainer role (GRPO's trainer, PPO's policy): `st` holds
// `t` (its models::trainer, set up by the role's setup request) and `m` (its rl_model). A save
// writes the policy in HF layout (what a save there held before: `held`); a push sends the
// versioned weights to the rollout actors.
template <class State>
void add_policy_save_push(role_builder& b, std::shared_ptr<State> st) {
  b.on<grpo_save_request>([st](role_context& c, const grpo_save_request& r) {
    TROUPE_CHECK(st->t, c.name(), ": a save before the setup");
    c.set_activity("saving");
    const auto held = models::hf::checkpoint_step(r.dir);
    auto saved = st->t->save(r.dir, st->m.cfg);
    TROUPE_CHECK(saved.has_value(), c.name(), ": ", saved.error_message());
    c.set_activity("idle");
    return grpo_save_reply{.version = st->t->steps_done(), .held = held.value_or(-1)};
  });
  b.on<grpo_push_request>([st](role_context& c, const grpo_push_request& r) {
    TROUPE_CHECK(st->t, c.name(), ": a push before the setup");
    return push_rl_weights(c, st->m.model->memory().params(), st->t->steps_done(), r.to);
  });
}

}  // namespace troupe::actors
