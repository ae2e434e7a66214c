// linear: forward and backward through ops::matmul on transposed views (see linear.hpp).
#include "models/layers/linear.hpp"

#include "memory/error.hpp"
#include "models/layers/weight_grads.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

void linear::declare(slot_list& s, std::string_view name, batch_dims) {
  TROUPE_CHECK(cfg.in > 0 && cfg.out > 0, "linear '", name, "': in and out must be > 0, got ",
               cfg.in, " and ", cfg.out);
  auto scope = s.enter(name);
  label = "linear '" + s.prefix() + "'";
  param_spec w, b;
  switch (cfg.split) {
    case tp_split::none:
      w = param_spec::replicated(param_init::normal);
      b = param_spec::replicated(param_init::zeros);
      break;
    case tp_split::column:
      w = param_spec::split_along(0, param_init::normal, cfg.sections);
      b = param_spec::split_along(0, param_init::zeros, cfg.sections);
      break;
    case tp_split::row:
      w = param_spec::split_along(1, param_init::normal);
      b = param_spec::replicated(param_init::zeros);
      break;
  }
  w.residual_out = cfg.residual_out;
  s.param("weight", {cfg.out, cfg.in}, weight, dweight, std::move(w));
  if (cfg.bias) s.param("bias", {cfg.out}, bias, dbias, std::move(b));
}

void linear::forward(const tensor& x_in, const tensor& y) {
  TROUPE_CHECK(weight.defined(), label, ": parameters are not bound");
  TROUPE_CHECK(x_in.defined() && x_in.dim() >= 1 && x_in.size(-1) == cfg.in, label,
               ": x must be [..., ", cfg.in, "], got ", describe(x_in));
  TROUPE_CHECK(x_in.is_contiguous(), label, ": x must be contiguous, got ", x_in.describe());
  TROUPE_CHECK(y.defined() && y.sizes() == with_last(x_in.sizes(), cfg.out), label, ": y must be ",
               with_last(x_in.sizes(), cfg.out).str(), ", got ", describe(y));
  TROUPE_CHECK(y.is_contiguous(), label, ": y must be contiguous, got ", y.describe());
  x = x_in;
  std::int64_t n = leading_rows(x.sizes());
  if (n == 0) return;
  tensor y2 = y.reshape({n, cfg.out});
  ops::matmul(x.reshape({n, cfg.in}), weight.transpose(0, 1), y2);
  if (cfg.bias) ops::add_bias(y2, bias);
}

void linear::backward(const tensor& dy, const tensor& dx, bool accumulate_dx) {
  TROUPE_CHECK(x.defined(), label, ": backward called before forward");
  TROUPE_CHECK(dy.defined() && dy.sizes() == with_last(x.sizes(), cfg.out), label, ": dy must be ",
               with_last(x.sizes(), cfg.out).str(), " like the output, got ", describe(dy));
  TROUPE_CHECK(!dx.defined() || dx.sizes() == x.sizes(), label, ": dx must be ", x.sizes().str(),
               " like the input, got ", describe(dx));
  TROUPE_CHECK(dy.is_contiguous() && (!dx.defined() || dx.is_contiguous()), label,
               ": dy and dx must be contiguous, got ", dy.describe(), " and ", describe(dx));
  std::int64_t n = leading_rows(x.sizes());
  if (n == 0) return;
  tensor dy2 = dy.reshape({n, cfg.out});
  tensor x2 = x.reshape({n, cfg.in});
  if (dx.defined())
    ops::matmul(dy2, weight, dx.reshape({n, cfg.in}), 1.0, accumulate_dx ? 1.0 : 0.0);
  if (auto* q = deferred_weight_grads::active()) {
    q->add(dweight, cfg.bias ? dbias : tensor{}, dy2, x2);
    return;
  }
  ops::matmul(dy2.transpose(0, 1), x2, dweight, 1.0, 1.0);
  if (cfg.bias) ops::sum_rows(dy2, dbias);
}

}  // namespace troupe::models
