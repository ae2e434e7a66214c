// layernorm: forward and backward through ops::layernorm (see layernorm.hpp).
#include "models/layers/layernorm.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

void layernorm::declare(slot_list& s, std::string_view name, batch_dims b) {
  TROUPE_CHECK(cfg.dim > 0, "layernorm '", name, "': dim must be > 0, got ", cfg.dim);
  auto scope = s.enter(name);
  label = "layernorm '" + s.prefix() + "'";
  s.param("weight", {cfg.dim}, weight, dweight, param_spec::replicated(param_init::ones));
  if (cfg.bias) s.param("bias", {cfg.dim}, bias, dbias, param_spec::replicated(param_init::zeros));
  s.activation("mean", {b.rows()}, mean);
  s.activation("rstd", {b.rows()}, rstd);
}

void layernorm::forward(const tensor& x_in, const tensor& y) {
  TROUPE_CHECK(weight.defined(), label, ": parameters are not bound");
  TROUPE_CHECK(x_in.defined() && x_in.dim() >= 1 && x_in.size(-1) == cfg.dim, label,
               ": x must be [..., ", cfg.dim, "], got ", describe(x_in));
  TROUPE_CHECK(y.defined() && y.sizes() == x_in.sizes(), label, ": y must be ", x_in.sizes().str(),
               " like x, got ", describe(y));
  x = x_in;
  std::int64_t n = leading_rows(x.sizes());
  ops::layernorm(x, weight, bias, y, planned_view(mean, {n}, label, "mean"),
                 planned_view(rstd, {n}, label, "rstd"), cfg.eps);
}

void layernorm::backward(const tensor& dy, const tensor& dx) {
  TROUPE_CHECK(x.defined(), label, ": backward called before forward");
  TROUPE_CHECK(dy.defined() && dy.sizes() == x.sizes() && dx.defined() && dx.sizes() == x.sizes(),
               label, ": dy and dx must be ", x.sizes().str(), " like x, got ", describe(dy),
               " and ", describe(dx));
  std::int64_t n = leading_rows(x.sizes());
  ops::layernorm_backward(dy, x, weight, planned_view(mean, {n}, label, "mean"),
                          planned_view(rstd, {n}, label, "rstd"), dx, dweight, dbias);
}

}  // namespace troupe::models
