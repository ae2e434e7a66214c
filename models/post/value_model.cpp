// value_model: per-token values on the trunk (value_model.hpp).
#include "models/post/value_model.hpp"

#include "memory/error.hpp"
#include "models/layers/slots.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

std::vector<double> value_model::forward(const tensor& ids) {
  TROUPE_CHECK(ids.defined() && ids.dim() == 2 && ids.type() == dtype::i32,
               "value model: ids must be i32 [B, T], got ", describe(ids));
  targets_.assign(static_cast<std::size_t>(ids.numel()), -100);
  lm().forward(ids, tensor(targets_.data(), targets_.size() * 4, dtype::i32, ids.sizes()));
  const tensor logits = lm().logits();  // [B * T, V + 1]: column V is the score
  owned_tensor host;
  if (!logits.is_cpu()) host = to_device(logits, device::cpu());
  const tensor& src = logits.is_cpu() ? logits : host;
  const std::int64_t n = src.size(0), v = rm_.vocab();
  owned_tensor col = empty({n, 1}, dtype::f64);
  ops::copy(src.narrow(1, v, 1), col);
  const double* p = col.data_as<double>();
  return {p, p + n};
}

void value_model::backward(std::span<const double> dvalues, double loss_scale) {
  const std::int64_t n = static_cast<std::int64_t>(targets_.size()), cols = rm_.vocab() + 1;
  TROUPE_CHECK(static_cast<std::int64_t>(dvalues.size()) == n, "value model: ", n, " values but ",
               dvalues.size(), " gradients");
  TROUPE_CHECK(lm().set_logit_grads([&](const tensor& dlogits, double dloss) {
    TROUPE_CHECK(dlogits.is_cpu(), "value model: the values' gradient is written on the host; ",
                 "logits on ", describe(dlogits));
    ops::fill(dlogits, 0.0);
    for (std::int64_t i = 0; i < n; ++i) {
      const double d = dloss * dvalues[static_cast<std::size_t>(i)];
      if (dlogits.type() == dtype::f32)
        dlogits.data_as<float>()[i * cols + cols - 1] = static_cast<float>(d);
      else
        dlogits.data_as<double>()[i * cols + cols - 1] = d;
    }
  }),
               "value model: the model cannot take the values' gradient");
  lm().backward(loss_scale);
  lm().set_logit_grads({});
}

}  // namespace troupe::models
