// preference_loss: DPO, IPO and Bradley-Terry losses (preference_loss.hpp).
#include "models/post/preference_loss.hpp"

#include <algorithm>
#include <cmath>
#include <string>

namespace troupe::models {
namespace {

// log sigmoid(x) = -log(1 + exp(-x)) without overflow.
double log_sigmoid(double x) {
  return std::min(x, 0.0) - std::log1p(std::exp(-std::abs(x)));
}
double sigmoid(double x) {
  return std::exp(log_sigmoid(x));
}

void check_pairs(std::size_t n, std::initializer_list<std::size_t> sizes, const char* who) {
  TROUPE_CHECK(n > 0, who, ": no pairs");
  for (std::size_t s : sizes)
    TROUPE_CHECK(s == n, who, ": every input needs one value per pair (", n, "), got ", s);
}

}  // namespace

expected<dpo_loss_type> parse_dpo_loss_type(std::string_view name) {
  if (name == "sigmoid") return dpo_loss_type::sigmoid;
  if (name == "ipo") return dpo_loss_type::ipo;
  return expected<dpo_loss_type>::failure("unknown DPO loss '" + std::string(name) +
                                          "' (use sigmoid or ipo)");
}

dpo_result dpo_loss(std::span<const double> policy_chosen, std::span<const double> policy_rejected,
                    std::span<const double> reference_chosen,
                    std::span<const double> reference_rejected, const dpo_options& opt) {
  const std::size_t n = policy_chosen.size();
  check_pairs(n, {policy_rejected.size(), reference_chosen.size(), reference_rejected.size()},
              "dpo_loss");
  TROUPE_CHECK(opt.beta > 0, "dpo_loss: beta must be > 0, got ", opt.beta);
  TROUPE_CHECK(opt.label_smoothing >= 0 && opt.label_smoothing < 0.5,
               "dpo_loss: label_smoothing must be in [0, 0.5), got ", opt.label_smoothing);
  const double b = opt.beta, eps = opt.label_smoothing, inv_n = 1.0 / static_cast<double>(n);
  dpo_result r;
  r.d_chosen.resize(n);
  r.d_rejected.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double z =
        (policy_chosen[i] - policy_rejected[i]) - (reference_chosen[i] - reference_rejected[i]);
    double l = 0, dz = 0;
    if (opt.type == dpo_loss_type::sigmoid) {
      l = -(1 - eps) * log_sigmoid(b * z) - eps * log_sigmoid(-b * z);
      // d/dz -log sigmoid(bz) = -b sigmoid(-bz); d/dz -log sigmoid(-bz) = b sigmoid(bz).
      dz = -(1 - eps) * b * sigmoid(-b * z) + eps * b * sigmoid(b * z);
    } else {
      const double e = z - 1 / (2 * b);
      l = e * e;
      dz = 2 * e;
    }
    r.loss += l * inv_n;
    r.d_chosen[i] = dz * inv_n;
    r.d_rejected[i] = -dz * inv_n;
    const double rc = b * (policy_chosen[i] - reference_chosen[i]);
    const double rr = b * (policy_rejected[i] - reference_rejected[i]);
    r.rewards_chosen += rc * inv_n;
    r.rewards_rejected += rr * inv_n;
    r.accuracy += rc > rr ? 1.0 : 0.0;
    r.margin += (rc - rr) * inv_n;
  }
  r.accuracy /= static_cast<double>(n);  // a fraction of pairs, as torch's mean gives it
  return r;
}

reward_result bradley_terry_loss(std::span<const double> chosen, std::span<const double> rejected) {
  const std::size_t n = chosen.size();
  check_pairs(n, {rejected.size()}, "bradley_terry_loss");
  const double inv_n = 1.0 / static_cast<double>(n);
  reward_result r;
  r.d_chosen.resize(n);
  r.d_rejected.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    const double d = chosen[i] - rejected[i];
    r.loss += -log_sigmoid(d) * inv_n;
    r.d_chosen[i] = -sigmoid(-d) * inv_n;
    r.d_rejected[i] = sigmoid(-d) * inv_n;
    r.accuracy += d > 0 ? 1.0 : 0.0;
  }
  r.accuracy /= static_cast<double>(n);
  return r;
}

}  // namespace troupe::models
