// grpo_loss: Group Relative Policy Optimization (Shao et al. 2024, DeepSeekMath), as TRL's
// GRPOTrainer computes it (TRL 0.14 to 0.16, and loss_type "grpo" of later TRL; written here from
// those formulas):
//
//   advantages: per prompt, a group of G completions with rewards r_1..r_G;
//     A_i = (r_i - mean(r)) / (std(r) + eps)   (std unbiased, as torch.std; eps 1e-4;
//                                               scale_rewards off: A_i = r_i - mean(r))
//   per completion token t of sequence i (mask m_it = 1 on the completion, its eos included):
//     ratio_it = exp(logp_it - old_it)                      (old: the policy that sampled)
//     l_it = -min(ratio_it A_i, clip(ratio_it, 1 - epsilon, 1 + epsilon) A_i)
//            + beta (exp(ref_it - logp_it) - (ref_it - logp_it) - 1)   (k3 KL to the reference)
//   loss = mean over sequences i of (sum_t m_it l_it / sum_t m_it)        ("sequence mean")
//
// beta = 0 drops the KL term (no reference pass needed). The gradient is taken with respect to the
// per-token log-probabilities logp_it; token_logprob.hpp carries it into the logits. A sequence
// with no completion token contributes 0 (TRL would divide by zero).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace troupe::models {

struct grpo_options {
  double epsilon = 0.2;  // clip range of the ratio (TRL's epsilon)
  double beta = 0.04;    // KL coefficient (TRL's default; 0: no reference model)
};

// Group-normalised advantages of rewards laid out group by group (size a multiple of `group`).
std::vector<double> group_advantages(std::span<const double> rewards, std::int64_t group,
                                     bool scale_rewards = true, double eps = 1e-4);

struct grpo_result {
  double loss = 0;
  std::vector<double> dlogp;  // d loss / d logp per token, [B * T] (0 off the mask)
  // The sequence-mean KL (averaged as the loss is; TRL's "kl" metric), and the share of masked
  // tokens whose clipped term is the smaller one (their gradient is cut).
  double kl = 0;
  double clip_ratio = 0;
};

// logp, old_logp, ref_logp, mask: [B * T] row-major per sequence; advantages: [B]. ref_logp may
// be empty when beta is 0 (kl is then 0).
grpo_result grpo_loss(std::span<const double> logp, std::span<const double> old_logp,
                      std::span<const double> ref_logp, std::span<const std::uint8_t> mask,
                      std::span<const double> advantages, const grpo_options& opt);

}  // namespace troupe::models
