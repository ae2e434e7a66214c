// ppo_loss: PPO's clipped policy objective and clipped value loss, as TRL's PPOTrainer computes
// them (TRL 0.11 and later; written here from those formulas). Over the response tokens (mask m)
// of a batch, as token means (TRL's masked_mean over the whole batch):
//
//   policy: ratio_t = exp(logp_t - old_t)                       (old: the policy that sampled)
//     pg_loss = mean_t max(-A_t ratio_t, -A_t clip(ratio_t, 1 - cliprange, 1 + cliprange))
//     clipfrac = share of tokens whose clipped term is the larger; approx_kl = mean 0.5 (logp -
//     old)^2
//   value: Vc_t = clip(V_t, Vold_t - cliprange_value, Vold_t + cliprange_value)
//     vf_loss = 0.5 mean_t max((V_t - R_t)^2, (Vc_t - R_t)^2); vf_clipfrac likewise
//
// TRL's loss is pg_loss + vf_coef vf_loss over one module holding both models; here the policy and
// the critic are separate models with their own optimizers, so each takes its own term (the critic
// vf_coef vf_loss). Gradients are in the per-token log-probabilities (token_logprob.hpp carries
// them into the logits) and in the per-token values (value_model.hpp). Where both sides of a max
// are equal (the ratio or value inside its clip range) the gradient is the unclipped one, as
// torch's max gives half through each side. An empty mask gives 0 and no gradient.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::models {

struct ppo_options {
  double cliprange = 0.2, cliprange_value = 0.2, vf_coef = 0.1;  // TRL's defaults
};

struct ppo_policy_result {
  double loss = 0;
  std::vector<double> dlogp;  // d pg_loss / d logp per token (0 off the mask)
  double clipfrac = 0, approx_kl = 0;
};

// logp, old_logp, advantages, mask: [N] (any row layout).
ppo_policy_result ppo_policy_loss(std::span<const double> logp, std::span<const double> old_logp,
                                  std::span<const double> advantages,
                                  std::span<const std::uint8_t> mask, double cliprange);

struct ppo_value_result {
  double loss = 0;              // vf_loss (without vf_coef)
  std::vector<double> dvalues;  // d vf_loss / d V per token (0 off the mask)
  double clipfrac = 0;
};

ppo_value_result ppo_value_loss(std::span<const double> values, std::span<const double> old_values,
                                std::span<const double> returns, std::span<const std::uint8_t> mask,
                                double cliprange_value);

// The policy's mean entropy over the masked rows of logits [N, V] (any floating dtype, any device:
// copied to the host): logsumexp(z) - sum softmax(z) z. Reported, not trained on.
double mean_token_entropy(const tensor& logits, std::span<const std::uint8_t> mask);

}  // namespace troupe::models
