// grpo_loss: GRPO's group advantages and clipped, KL-penalised loss (grpo_loss.hpp).
#include "models/post/grpo_loss.hpp"

#include <algorithm>
#include <cmath>

#include "memory/error.hpp"

namespace troupe::models {

std::vector<double> group_advantages(std::span<const double> rewards, std::int64_t group,
                                     bool scale_rewards, double eps) {
  TROUPE_CHECK(group > 0 && rewards.size() % static_cast<std::size_t>(group) == 0,
               "group_advantages: ", rewards.size(), " rewards are not whole groups of ", group);
  const auto g = static_cast<std::size_t>(group);
  std::vector<double> out(rewards.size());
  for (std::size_t s = 0; s < rewards.size(); s += g) {
    double mean = 0;
    for (std::size_t i = 0; i < g; ++i) mean += rewards[s + i];
    mean /= static_cast<double>(g);
    double var = 0;
    for (std::size_t i = 0; i < g; ++i) var += (rewards[s + i] - mean) * (rewards[s + i] - mean);
    // torch.std is unbiased (n - 1); a group of one has NaN std there: 0 advantage here.
    const double std = g > 1 ? std::sqrt(var / static_cast<double>(g - 1)) : 0.0;
    for (std::size_t i = 0; i < g; ++i) {
      const double a = rewards[s + i] - mean;
      out[s + i] = scale_rewards ? a / (std + eps) : a;
    }
  }
  return out;
}

grpo_result grpo_loss(std::span<const double> logp, std::span<const double> old_logp,
                      std::span<const double> ref_logp, std::span<const std::uint8_t> mask,
                      std::span<const double> advantages, const grpo_options& opt) {
  const std::size_t n = logp.size(), b = advantages.size();
  TROUPE_CHECK(b > 0 && n % b == 0, "grpo_loss: ", n, " token log-probabilities are not ", b,
               " sequences");
  TROUPE_CHECK(old_logp.size() == n && mask.size() == n, "grpo_loss: ", n,
               " log-probabilities but ", old_logp.size(), " old ones and ", mask.size(),
               " mask entries");
  TROUPE_CHECK(opt.beta == 0 || ref_logp.size() == n, "grpo_loss: beta ", opt.beta, " needs ", n,
               " reference log-probabilities, got ", ref_logp.size());
  TROUPE_CHECK(opt.epsilon >= 0 && opt.beta >= 0, "grpo_loss: epsilon ", opt.epsilon, " and beta ",
               opt.beta, " must be >= 0");
  const std::size_t t = n / b;
  const bool with_ref = ref_logp.size() == n;  // beta 0: the KL only as a metric, if given
  grpo_result r;
  r.dlogp.assign(n, 0.0);
  std::size_t masked = 0, clipped = 0;
  for (std::size_t i = 0; i < b; ++i) {
    const double a = advantages[i];
    std::size_t count = 0;
    for (std::size_t k = i * t; k < (i + 1) * t; ++k) count += mask[k] != 0;
    if (count == 0) continue;
    // d loss / d l_it = 1 / (count_i * B): the mean over the sequence, then over the batch.
    const double w = 1.0 / (static_cast<double>(count) * static_cast<double>(b));
    double seq_loss = 0, seq_kl = 0;
    for (std::size_t k = i * t; k < (i + 1) * t; ++k) {
      if (mask[k] == 0) continue;
      const double ratio = std::exp(logp[k] - old_logp[k]);
      const double clamped = std::clamp(ratio, 1.0 - opt.epsilon, 1.0 + opt.epsilon);
      const double unclipped_term = ratio * a, clipped_term = clamped * a;
      // -min(...): the unclipped term's gradient d(ratio A)/d logp = ratio A flows when it is
      // the smaller one, or when the clamp passes it through (ratio inside the range: both equal).
      double l = -std::min(unclipped_term, clipped_term);
      double d = 0;
      const bool inside = ratio >= 1.0 - opt.epsilon && ratio <= 1.0 + opt.epsilon;
      if (unclipped_term < clipped_term || inside) d = -ratio * a;
      clipped += unclipped_term > clipped_term;  // TRL: is_clipped = loss1 < loss2 of -terms
      if (with_ref) {
        const double delta = ref_logp[k] - logp[k];
        const double kl = std::exp(delta) - delta - 1.0;
        l += opt.beta * kl;
        d += opt.beta * (1.0 - std::exp(delta));  // d kl / d logp
        seq_kl += kl;
      }
      seq_loss += l;
      r.dlogp[k] = d * w;
      ++masked;
    }
    r.loss += seq_loss * w;
    r.kl += seq_kl / static_cast<double>(count) / static_cast<double>(b);
  }
  r.clip_ratio = masked == 0 ? 0.0 : static_cast<double>(clipped) / static_cast<double>(masked);
  return r;
}

}  // namespace troupe::models
