// ppo_loss: PPO's clipped policy and value losses (ppo_loss.hpp).
#include "models/post/ppo_loss.hpp"

#include <algorithm>
#include <cmath>

#include "memory/error.hpp"
#include "models/layers/slots.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

std::size_t masked_count(std::span<const std::uint8_t> mask) {
  return static_cast<std::size_t>(std::ranges::count_if(mask, [](auto m) { return m != 0; }));
}

}  // namespace

ppo_policy_result ppo_policy_loss(std::span<const double> logp, std::span<const double> old_logp,
                                  std::span<const double> advantages,
                                  std::span<const std::uint8_t> mask, double cliprange) {
  const std::size_t n = logp.size();
  TROUPE_CHECK(old_logp.size() == n && advantages.size() == n && mask.size() == n, "ppo: ", n,
               " log-probabilities but ", old_logp.size(), " old ones, ", advantages.size(),
               " advantages and ", mask.size(), " mask entries");
  TROUPE_CHECK(cliprange >= 0, "ppo: cliprange ", cliprange, " must be >= 0");
  ppo_policy_result r;
  r.dlogp.assign(n, 0.0);
  const std::size_t count = masked_count(mask);
  if (count == 0) return r;
  const double w = 1.0 / static_cast<double>(count);
  std::size_t clipped = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (mask[i] == 0) continue;
    const double a = advantages[i], diff = logp[i] - old_logp[i], ratio = std::exp(diff);
    const double pg1 = -a * ratio;
    const double pg2 = -a * std::clamp(ratio, 1.0 - cliprange, 1.0 + cliprange);
    r.loss += std::max(pg1, pg2) * w;
    // The unclipped term's gradient -A ratio flows when it is the larger one, or when the clamp
    // passes the ratio through (inside the range both terms are one); a clamped ratio has none.
    const bool inside = ratio >= 1.0 - cliprange && ratio <= 1.0 + cliprange;
    if (pg1 > pg2 || inside) r.dlogp[i] = -a * ratio * w;
    clipped += pg2 > pg1;
    r.approx_kl += 0.5 * diff * diff * w;
  }
  r.clipfrac = static_cast<double>(clipped) * w;
  return r;
}

ppo_value_result ppo_value_loss(std::span<const double> values, std::span<const double> old_values,
                                std::span<const double> returns, std::span<const std::uint8_t> mask,
                                double cliprange_value) {
  const std::size_t n = values.size();
  TROUPE_CHECK(old_values.size() == n && returns.size() == n && mask.size() == n, "ppo: ", n,
               " values but ", old_values.size(), " old ones, ", returns.size(), " returns and ",
               mask.size(), " mask entries");
  TROUPE_CHECK(cliprange_value >= 0, "ppo: cliprange_value ", cliprange_value, " must be >= 0");
  ppo_value_result r;
  r.dvalues.assign(n, 0.0);
  const std::size_t count = masked_count(mask);
  if (count == 0) return r;
  const double w = 1.0 / static_cast<double>(count);
  std::size_t clipped = 0;
  for (std::size_t i = 0; i < n; ++i) {
    if (mask[i] == 0) continue;
    const double v = values[i], lo = old_values[i] - cliprange_value,
                 hi = old_values[i] + cliprange_value;
    const double vc = std::clamp(v, lo, hi);
    const double l1 = (v - returns[i]) * (v - returns[i]);
    const double l2 = (vc - returns[i]) * (vc - returns[i]);
    r.loss += 0.5 * std::max(l1, l2) * w;
    // d 0.5 (V - R)^2 / dV = V - R; through the clamp only inside the range (then vc = V).
    const bool inside = v >= lo && v <= hi;
    if (l1 > l2 || inside) r.dvalues[i] = (v - returns[i]) * w;
    clipped += l2 > l1;
  }
  r.clipfrac = static_cast<double>(clipped) * w;
  return r;
}

double mean_token_entropy(const tensor& logits, std::span<const std::uint8_t> mask) {
  TROUPE_CHECK(logits.defined() && logits.dim() == 2 &&
                   static_cast<std::size_t>(logits.size(0)) == mask.size(),
               "ppo: entropy of logits ", describe(logits), " with ", mask.size(), " mask entries");
  owned_tensor host;
  if (!logits.is_cpu()) host = to_device(logits, device::cpu());
  const tensor& src = logits.is_cpu() ? logits : host;
  owned_tensor wide = empty(src.sizes(), dtype::f64);
  ops::copy(src, wide);
  const std::int64_t v = src.size(1);
  const double* z = wide.data_as<double>();
  double sum = 0;
  std::size_t count = 0;
  for (std::size_t r = 0; r < mask.size(); ++r) {
    if (mask[r] == 0) continue;
    const double* row = z + static_cast<std::int64_t>(r) * v;
    const double top = *std::max_element(row, row + v);
    double s = 0, zs = 0;
    for (std::int64_t k = 0; k < v; ++k) {
      const double e = std::exp(row[k] - top);
      s += e;
      zs += e * row[k];
    }
    sum += top + std::log(s) - zs / s;
    ++count;
  }
  return count == 0 ? 0.0 : sum / static_cast<double>(count);
}

}  // namespace troupe::models
