// swiglu_mlp: gate/up projections -> SwiGLU -> down projection, forward and backward.
#include "models/layers/swiglu_mlp.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

void swiglu_mlp::declare(slot_list& s, std::string_view name, batch_dims b) {
  TROUPE_CHECK(cfg.dim > 0 && cfg.hidden > 0, "swiglu_mlp '", name,
               "': dim and hidden must be > 0, got ", cfg.dim, " and ", cfg.hidden);
  auto scope = s.enter(name);
  label = "swiglu_mlp '" + s.prefix() + "'";
  gate_proj.declare(s, "gate_proj", b);
  up_proj.declare(s, "up_proj", b);
  down_proj.declare(s, "down_proj", b);
  shape hs{b.rows(), cfg.hidden};
  s.activation("gate", hs, gate);
  s.activation("up", hs, up);
  s.activation("a", hs, a);
  s.scratch("da", hs, da);
  s.scratch("dgate", hs, dgate);
  s.scratch("dup", hs, dup);
}

void swiglu_mlp::forward(const tensor& x, const tensor& y) {
  TROUPE_CHECK(x.defined() && x.dim() >= 1 && x.size(-1) == cfg.dim, label, ": x must be [..., ",
               cfg.dim, "], got ", describe(x));
  shape hs = with_last(x.sizes(), cfg.hidden);
  tensor g = planned_view(gate, hs, label, "gate");
  tensor u = planned_view(up, hs, label, "up");
  tensor av = planned_view(a, hs, label, "a");
  gate_proj.forward(x, g);
  up_proj.forward(x, u);
  ops::swiglu(g, u, av);
  down_proj.forward(av, y);
}

void swiglu_mlp::backward(const tensor& dy, const tensor& dx) {
  TROUPE_CHECK(gate_proj.x.defined(), label, ": backward called before forward");
  shape hs = with_last(gate_proj.x.sizes(), cfg.hidden);
  tensor dav = planned_view(da, hs, label, "da");
  tensor dg = planned_view(dgate, hs, label, "dgate");
  tensor du = planned_view(dup, hs, label, "dup");
  down_proj.backward(dy, dav);
  ops::swiglu_backward(planned_view(gate, hs, label, "gate"), planned_view(up, hs, label, "up"),
                       dav, dg, du);
  gate_proj.backward(dg, dx);
  up_proj.backward(du, dx, /*accumulate_dx=*/true);
}

}  // namespace troupe::models
