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
#include "models/causal_lm.hpp"
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

}  // namespace troupe::actors
