// cross_entropy_loss: mean cross-entropy over non-ignored positions (see cross_entropy.hpp).
#include "models/layers/cross_entropy.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

void cross_entropy_loss::declare(slot_list& s, std::string_view name, batch_dims b) {
  auto scope = s.enter(name);
  label = "cross_entropy_loss '" + s.prefix() + "'";
  s.activation("losses", {b.rows()}, losses);
}

double cross_entropy_loss::forward(const tensor& logits_in, const tensor& targets_in) {
  TROUPE_CHECK(logits_in.defined() && logits_in.dim() >= 1, label,
               ": logits must be [..., V], got ", describe(logits_in));
  shape rows = logits_in.sizes();
  rows.erase(rows.rank() - 1);
  TROUPE_CHECK(targets_in.defined() && targets_in.sizes() == rows, label, ": targets must be ",
               rows.str(), " to match logits ", logits_in.sizes().str(), ", got ",
               describe(targets_in));
  logits = logits_in;
  targets = targets_in;
  std::int64_t n = leading_rows(logits.sizes());
  tensor l = planned_view(losses, {n}, label, "losses");
  count = ops::cross_entropy(logits, targets, l, tensor{}, 0.0, cfg.ignore_index);
  return count == 0 ? 0.0 : ops::sum(l) / static_cast<double>(count);
}

void cross_entropy_loss::backward(const tensor& dlogits, double dloss) {
  TROUPE_CHECK(logits.defined(), label, ": backward called before forward");
  TROUPE_CHECK(dlogits.defined() && dlogits.sizes() == logits.sizes(), label, ": dlogits must be ",
               logits.sizes().str(), " like the logits, got ", describe(dlogits));
  std::int64_t n = leading_rows(logits.sizes());
  if (logit_grads) {
    logit_grads(dlogits, dloss);
    return;
  }
  if (!sequence_weights.empty()) {
    const auto seqs = static_cast<std::int64_t>(sequence_weights.size());
    TROUPE_CHECK(n % seqs == 0, label, ": ", n, " rows are not ", seqs, " sequences");
    const std::int64_t t = n / seqs;
    tensor l = planned_view(losses, {n}, label, "losses");
    for (std::int64_t b = 0; b < seqs; ++b)
      ops::cross_entropy(logits.narrow(0, b * t, t), targets.reshape({n}).narrow(0, b * t, t),
                         l.narrow(0, b * t, t), dlogits.narrow(0, b * t, t),
                         dloss * sequence_weights[static_cast<std::size_t>(b)], cfg.ignore_index);
    return;
  }
  double grad_scale = count == 0 ? 0.0 : dloss / static_cast<double>(count);
  ops::cross_entropy(logits, targets, planned_view(losses, {n}, label, "losses"), dlogits,
                     grad_scale, cfg.ignore_index);
}

}  // namespace troupe::models
