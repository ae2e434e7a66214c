// preference_loss: the losses of preference training over per-sequence scalars, with their
// gradients, in f64 (a batch has a few sequences; the scalars come from the trunk's f32 logits).
//
// DPO (Rafailov et al.; TRL DPOTrainer.dpo_loss), per pair i with z_i = (pi_c - pi_r) - (ref_c -
// ref_r), the summed log-probabilities of the chosen and rejected responses under the policy and
// the frozen reference:
//   sigmoid: l_i = -(1 - eps) log sigmoid(beta z_i) - eps log sigmoid(-beta z_i)   (eps: label
//            smoothing, the conservative DPO)
//   ipo:     l_i = (z_i - 1 / (2 beta))^2   (TRL feeds IPO the log-probabilities averaged over
//            the response tokens: sequence_logprobs' `average`)
//   loss = mean_i l_i; gradients w.r.t. pi_c and pi_r (the reference has none).
// Metrics as TRL names them: rewards/chosen = mean beta (pi_c - ref_c), rewards/rejected = mean
// beta (pi_r - ref_r), rewards/accuracies = mean [rewards_c > rewards_r], rewards/margins = mean
// (rewards_c - rewards_r).
//
// Reward model (Bradley-Terry, TRL RewardTrainer): loss = mean_i -log sigmoid(r_c,i - r_r,i),
// accuracy = mean [r_c > r_r].
#pragma once

#include <span>
#include <string_view>
#include <vector>

#include "memory/error.hpp"

namespace troupe::models {

enum class dpo_loss_type { sigmoid, ipo };
expected<dpo_loss_type> parse_dpo_loss_type(std::string_view name);  // "sigmoid" or "ipo"

struct dpo_options {
  dpo_loss_type type = dpo_loss_type::sigmoid;
  double beta = 0.1;
  double label_smoothing = 0.0;  // sigmoid only, in [0, 0.5)
};

struct dpo_result {
  double loss = 0;
  std::vector<double> d_chosen, d_rejected;  // d loss / d pi_c, d pi_r per pair
  double rewards_chosen = 0, rewards_rejected = 0, accuracy = 0, margin = 0;
};

// All four spans have one entry per pair (at least one). Throws troupe::error naming the option
// for beta <= 0 or label_smoothing outside [0, 0.5).
dpo_result dpo_loss(std::span<const double> policy_chosen, std::span<const double> policy_rejected,
                    std::span<const double> reference_chosen,
                    std::span<const double> reference_rejected, const dpo_options& opt);

struct reward_result {
  double loss = 0;
  std::vector<double> d_chosen, d_rejected;
  double accuracy = 0;
};

reward_result bradley_terry_loss(std::span<const double> chosen, std::span<const double> rejected);

}  // namespace troupe::models
