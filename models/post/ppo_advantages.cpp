// ppo_advantages: PPO's per-token rewards, GAE and whitening (ppo_advantages.hpp).
#include "models/post/ppo_advantages.hpp"

#include <cmath>

#include "memory/error.hpp"

namespace troupe::models {

std::vector<double> masked_whiten(std::span<const double> x, std::span<const std::uint8_t> mask,
                                  bool shift_mean) {
  TROUPE_CHECK(x.size() == mask.size(), "masked_whiten: ", x.size(), " values but ", mask.size(),
               " mask entries");
  double n = 0, mean = 0;
  for (std::size_t i = 0; i < x.size(); ++i)
    if (mask[i] != 0) {
      n += 1;
      mean += x[i];
    }
  TROUPE_CHECK(n >= 2, "masked_whiten: ", n, " masked entries; the unbiased variance needs two");
  mean /= n;
  double var = 0;
  for (std::size_t i = 0; i < x.size(); ++i)
    if (mask[i] != 0) var += (x[i] - mean) * (x[i] - mean);
  var = var / n * (n / (n - 1));  // TRL: the masked mean of the squares, then Bessel's factor
  const double scale = 1.0 / std::sqrt(var + 1e-8);
  std::vector<double> out(x.size(), 0.0);
  for (std::size_t i = 0; i < x.size(); ++i)
    if (mask[i] != 0) out[i] = (x[i] - mean) * scale + (shift_mean ? 0.0 : mean);
  return out;
}

std::vector<double> generalized_advantages(std::span<const double> rewards,
                                           std::span<const double> values,
                                           std::span<const std::uint8_t> mask, std::int64_t rows,
                                           double gamma, double lam) {
  const std::size_t n = rewards.size();
  TROUPE_CHECK(rows > 0 && n % static_cast<std::size_t>(rows) == 0, "gae: ", n, " rewards are not ",
               rows, " rows");
  TROUPE_CHECK(values.size() == n && mask.size() == n, "gae: ", n, " rewards but ", values.size(),
               " values and ", mask.size(), " mask entries");
  const std::size_t t = n / static_cast<std::size_t>(rows);
  std::vector<double> adv(n, 0.0);
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    double last = 0;  // A of the next position (0 past the response)
    for (std::size_t k = t; k-- > 0;) {
      const std::size_t i = r * t + k;
      if (mask[i] == 0) {
        last = 0;
        continue;
      }
      const double next = k + 1 < t && mask[i + 1] != 0 ? values[i + 1] : 0.0;
      const double delta = rewards[i] + gamma * next - values[i];
      last = delta + gamma * lam * last;
      adv[i] = last;
    }
  }
  return adv;
}

ppo_advantages ppo_token_advantages(std::span<const double> old_logp,
                                    std::span<const double> ref_logp,
                                    std::span<const double> values,
                                    std::span<const std::uint8_t> mask,
                                    std::span<const double> scores, const ppo_reward_options& opt) {
  const std::size_t n = old_logp.size(), b = scores.size();
  TROUPE_CHECK(b > 0 && n % b == 0, "ppo: ", n, " log-probabilities are not ", b, " rows");
  TROUPE_CHECK(values.size() == n && mask.size() == n, "ppo: ", n, " log-probabilities but ",
               values.size(), " values and ", mask.size(), " mask entries");
  TROUPE_CHECK(opt.kl_coef == 0 || ref_logp.size() == n, "ppo: kl_coef ", opt.kl_coef, " needs ", n,
               " reference log-probabilities, got ", ref_logp.size());
  TROUPE_CHECK(opt.kl_coef >= 0 && opt.gamma >= 0 && opt.gamma <= 1 && opt.lam >= 0 && opt.lam <= 1,
               "ppo: kl_coef ", opt.kl_coef, " must be >= 0, gamma ", opt.gamma, " and lambda ",
               opt.lam, " in [0, 1]");
  const std::size_t t = n / b;
  const bool with_ref = ref_logp.size() == n;
  ppo_advantages out;
  out.rewards.assign(n, 0.0);
  for (std::size_t r = 0; r < b; ++r) {
    std::size_t last = 0;  // the row's last response token
    bool any = false;
    double row_kl = 0;
    for (std::size_t k = 0; k < t; ++k) {
      const std::size_t i = r * t + k;
      if (mask[i] == 0) continue;
      last = i;
      any = true;
      double kl = 0;
      if (with_ref) {
        const double logr = ref_logp[i] - old_logp[i];
        kl = opt.kl == kl_estimator::k1 ? -logr : std::exp(logr) - 1.0 - logr;
      }
      row_kl += kl;
      out.rewards[i] = -opt.kl_coef * kl;
    }
    // A row without a response token has nowhere to put its score (TRL always has one).
    if (any) out.rewards[last] += scores[r];
    out.kl += row_kl / static_cast<double>(b);
    out.non_score_reward += -opt.kl_coef * row_kl / static_cast<double>(b);
  }
  if (opt.whiten_rewards) out.rewards = masked_whiten(out.rewards, mask, false);
  const std::vector<double> adv = generalized_advantages(
      out.rewards, values, mask, static_cast<std::int64_t>(b), opt.gamma, opt.lam);
  out.returns.assign(n, 0.0);
  for (std::size_t i = 0; i < n; ++i)
    if (mask[i] != 0) out.returns[i] = adv[i] + values[i];
  out.advantages = masked_whiten(adv, mask);
  return out;
}

}  // namespace troupe::models
