#include "models/optim.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "memory/error.hpp"

namespace troupe::models {

double clip_grad_norm(const tensor& grads, double max_norm) {
  double norm = std::sqrt(ops::sum_squares(grads));
  if (max_norm > 0 && norm > max_norm) ops::scale(grads, max_norm / (norm + 1e-6));
  return norm;
}

adamw_optimizer::adamw_optimizer(const tensor& params, const ops::adamw_options& opt)
    : opt_(opt),
      m_(zeros(params.sizes(), params.type(), params.dev())),
      v_(zeros(params.sizes(), params.type(), params.dev())) {}

void adamw_optimizer::step(const tensor& params, const tensor& grads, double lr) {
  TROUPE_CHECK(params.sizes() == m_.sizes(), "adamw_optimizer: parameters ", params.describe(),
               " differ from the ones it was made for ", m_.describe());
  ++step_;
  ops::adamw_options o = opt_;
  o.lr = lr;
  o.step = step_;
  ops::adamw(params, grads, m_, v_, o);
}

double warmup_cosine_lr(std::int64_t step, std::int64_t warmup, std::int64_t total, double lr,
                        double min_lr) {
  if (warmup > 0 && step < warmup)
    return lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  if (total <= warmup) return lr;
  double p = std::clamp(static_cast<double>(step - warmup) / static_cast<double>(total - warmup),
                        0.0, 1.0);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + std::cos(std::numbers::pi * p));
}

}  // namespace troupe::models
