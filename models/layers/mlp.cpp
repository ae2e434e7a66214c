// mlp: fc -> GELU (tanh) -> proj, forward and backward (see mlp.hpp).
#include "models/layers/mlp.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

void mlp::declare(slot_list& s, std::string_view name, batch_dims b) {
  TROUPE_CHECK(cfg.dim > 0 && cfg.hidden > 0, "mlp '", name, "': dim and hidden must be > 0, got ",
               cfg.dim, " and ", cfg.hidden);
  auto scope = s.enter(name);
  label = "mlp '" + s.prefix() + "'";
  fc.declare(s, "fc", b);
  proj.declare(s, "proj", b);
  s.activation("h", {b.rows(), cfg.hidden}, h);
  s.activation("a", {b.rows(), cfg.hidden}, a);
  s.scratch("da", {b.rows(), cfg.hidden}, da);
  s.scratch("dh", {b.rows(), cfg.hidden}, dh);
}

void mlp::forward(const tensor& x, const tensor& y) {
  TROUPE_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == cfg.dim, label, ": x must be [..., ",
               cfg.dim, "], got ", describe(x));
  shape hs = with_last(x.sizes(), cfg.hidden);
  tensor hv = planned_view(h, hs, label, "h");
  tensor av = planned_view(a, hs, label, "a");
  fc.forward(x, hv);
  ops::gelu(hv, av);
  proj.forward(av, y);
}

void mlp::backward(const tensor& dy, const tensor& dx) {
  TROUPE_CHECK(fc.x.defined(), label, ": backward called before forward");
  shape hs = with_last(fc.x.sizes(), cfg.hidden);
  tensor dav = planned_view(da, hs, label, "da");
  tensor dhv = planned_view(dh, hs, label, "dh");
  proj.backward(dy, dav);
  ops::gelu_backward(planned_view(h, hs, label, "h"), dav, dhv);
  fc.backward(dhv, dx);
}

}  // namespace troupe::models
