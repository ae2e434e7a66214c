// ppo_advantages: PPO's per-token rewards, generalized advantage estimation (Schulman et al. 2016)
// and advantage whitening, as TRL's PPOTrainer computes them (TRL 0.11 and later; written here from
// those formulas):
//
//   per response token t of row i (mask m_it = 1 on the response, its eos included; the response
//   tokens of a row are contiguous):
//     kl_it = old_it - ref_it                   (k1: TRL's default kl_estimator)
//           or exp(ref_it - old_it) - 1 - (ref_it - old_it)                  (k3)
//     r_it = -kl_coef kl_it, plus the row's score s_i on its last response token
//     (whiten_rewards: r = whiten(r) without shifting the mean, as TRL's option)
//   GAE backwards over the row, values V zero off the response:
//     delta_it = r_it + gamma V_i,t+1 - V_it;   A_it = delta_it + gamma lambda A_i,t+1
//   returns R = A + V (before whitening); advantages = whiten(A), zero off the response
//   whiten(x) = (x - mean) / sqrt(var + 1e-8): mean and unbiased variance over all masked tokens
//   of the batch.
//
// old: the sampling policy's log-probabilities (the rollout's), ref: the frozen reference's, V:
// the critic's values at the positions that predict each token (value_model.hpp). TRL's value
// mask reaches one token past the response when its pad token differs from eos (and the score
// lands on that pad); here the response ends at its eos, which is TRL's pad == eos case.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace troupe::models {

enum class kl_estimator : std::uint8_t { k1, k3 };

struct ppo_reward_options {
  double kl_coef = 0.05;  // TRL's defaults
  kl_estimator kl = kl_estimator::k1;
  bool whiten_rewards = false;
  double gamma = 1.0, lam = 0.95;
};

struct ppo_advantages {
  std::vector<double> rewards;     // per token [B * T], 0 off the mask
  std::vector<double> advantages;  // whitened, 0 off the mask
  std::vector<double> returns;     // A + V before whitening, 0 off the mask
  double kl = 0;                   // mean over rows of the row's summed kl (TRL's objective/kl)
  double non_score_reward = 0;     // mean over rows of the summed -kl_coef kl
};

// (x - mean) / sqrt(var + 1e-8) over the masked entries (unbiased variance; at least two), plus
// the mean back when shift_mean is false; entries off the mask are set to 0.
std::vector<double> masked_whiten(std::span<const double> x, std::span<const std::uint8_t> mask,
                                  bool shift_mean = true);

// GAE of per-token rewards and values laid out [rows, T] (size a multiple of rows), 0 off mask.
std::vector<double> generalized_advantages(std::span<const double> rewards,
                                           std::span<const double> values,
                                           std::span<const std::uint8_t> mask, std::int64_t rows,
                                           double gamma, double lam);

// All of it: old_logp, ref_logp, values, mask [rows * T]; scores [rows].
ppo_advantages ppo_token_advantages(std::span<const double> old_logp,
                                    std::span<const double> ref_logp,
                                    std::span<const double> values,
                                    std::span<const std::uint8_t> mask,
                                    std::span<const double> scores, const ppo_reward_options& opt);

}  // namespace troupe::models
