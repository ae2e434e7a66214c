#include "models/optim.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "memory/error.hpp"
#include "models/layers/slots.hpp"

namespace troupe::models {

double clip_factor(double norm, double max_norm) {
  return max_norm > 0 && norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
}

double clip_grad_norm(const tensor& grads, double max_norm) {
  double norm = std::sqrt(ops::sum_squares(grads));
  if (const double f = clip_factor(norm, max_norm); f != 1.0) ops::scale(grads, f);
  return norm;
}

adamw_optimizer::adamw_optimizer(const tensor& params, const ops::adamw_options& opt)
    : opt_(opt),
      m_(zeros(params.sizes(), params.type(), params.dev())),
      v_(zeros(params.sizes(), params.type(), params.dev())) {}

void adamw_optimizer::exempt_from_decay(const slot_list& slots, const tensor& params,
                                        bool (*no_decay)(const tensor_slot&)) {
  TROUPE_CHECK(params.sizes() == m_.sizes() && params.dim() == 1, "adamw_optimizer: parameters ",
               params.describe(),
               " differ from the ones it was "
               "made for ",
               m_.describe());
  // Mark the exempt ranges, then cut the flat buffer into runs of equal treatment.
  std::vector<bool> exempt(static_cast<std::size_t>(params.numel()), false);
  const auto elem = static_cast<std::ptrdiff_t>(params.element_size());
  for (const auto& s : slots.slots()) {
    if (s.kind != slot_kind::param || !no_decay(s)) continue;
    std::ptrdiff_t off =
        (static_cast<const char*>(s.field->data()) - static_cast<const char*>(params.data())) /
        elem;
    TROUPE_CHECK(off >= 0 && off + s.field->numel() <= params.numel(),
                 "adamw_optimizer: parameter '", s.name,
                 "' does not live in the flat parameter buffer");
    std::fill_n(exempt.begin() + off, s.field->numel(), true);
  }
  segments_.clear();
  for (std::int64_t i = 0; i < params.numel();) {
    std::int64_t j = i;
    while (j < params.numel() && exempt[j] == exempt[i]) ++j;
    segments_.push_back({i, j - i, !exempt[i]});
    i = j;
  }
}

void adamw_optimizer::step(const tensor& params, const tensor& grads, double lr) {
  TROUPE_CHECK(params.sizes() == m_.sizes(), "adamw_optimizer: parameters ", params.describe(),
               " differ from the ones it was made for ", m_.describe());
  ++step_;
  ops::adamw_options o = opt_;
  o.lr = lr;
  o.step = step_;
  if (segments_.empty()) {
    ops::adamw(params, grads, m_, v_, o);
    return;
  }
  for (const auto& seg : segments_) {
    o.weight_decay = seg.decay ? opt_.weight_decay : 0.0;
    ops::adamw(params.narrow(0, seg.begin, seg.length), grads.narrow(0, seg.begin, seg.length),
               m_.narrow(0, seg.begin, seg.length), v_.narrow(0, seg.begin, seg.length), o);
  }
}

bool biases_norms_embeddings(const tensor_slot& parameter) {
  return parameter.sizes.rank() < 2 || parameter.spec.embedding;
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
