// attention: projections, RoPE, flash-style attention and the output projection (attention.hpp).
#include "models/layers/attention.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

attention::attention(const config& c) : cfg(c) {
  if (cfg.n_kv_head == 0) cfg.n_kv_head = cfg.n_head;
  if (cfg.head_dim == 0 && cfg.n_head > 0) cfg.head_dim = cfg.dim / cfg.n_head;
  std::int64_t hq = cfg.n_head * cfg.head_dim, hkv = cfg.n_kv_head * cfg.head_dim;
  // Under tensor parallelism the heads are split: q, k and v column-parallel (the fused rows as
  // three sections, each split by heads), o_proj row-parallel.
  if (cfg.fused_qkv) {
    qkv_proj = linear({cfg.dim, hq + 2 * hkv, cfg.qkv_bias, tp_split::column, {hq, hkv, hkv}});
  } else {
    q_proj = linear({cfg.dim, hq, cfg.qkv_bias, tp_split::column});
    k_proj = linear({cfg.dim, hkv, cfg.qkv_bias, tp_split::column});
    v_proj = linear({cfg.dim, hkv, cfg.qkv_bias, tp_split::column});
  }
  o_proj = linear({hq, cfg.dim, cfg.out_bias, tp_split::row, {}, /*residual_out=*/true});
}

void attention::declare(slot_list& s, std::string_view name, batch_dims b) {
  TROUPE_CHECK(cfg.dim > 0 && cfg.n_head > 0 && cfg.n_kv_head > 0 && cfg.head_dim > 0,
               "attention '", name, "': dim, n_head, n_kv_head and head_dim must be > 0, got ",
               cfg.dim, ", ", cfg.n_head, ", ", cfg.n_kv_head, ", ", cfg.head_dim);
  TROUPE_CHECK(cfg.n_head % cfg.n_kv_head == 0, "attention '", name, "': n_head (", cfg.n_head,
               ") must be a multiple of n_kv_head (", cfg.n_kv_head, ")");
  TROUPE_CHECK(!cfg.rope || cfg.head_dim % 2 == 0, "attention '", name,
               "': RoPE needs an even head_dim, got ", cfg.head_dim);
  TROUPE_CHECK(!cfg.rope || cfg.rope_theta > 0, "attention '", name,
               "': rope_theta must be > 0, got ", cfg.rope_theta);
  if (cfg.rope)
    check_rope_scaling(cfg.rope_scale, cfg.head_dim, "attention '" + std::string(name) + "'");
  auto scope = s.enter(name);
  label = "attention '" + s.prefix() + "'";
  std::int64_t hq = cfg.n_head, hkv = cfg.n_kv_head, d = cfg.head_dim;
  if (cfg.fused_qkv) {
    qkv_proj.declare(s, "qkv_proj", b);
  } else {
    q_proj.declare(s, "q_proj", b);
    k_proj.declare(s, "k_proj", b);
    v_proj.declare(s, "v_proj", b);
  }
  o_proj.declare(s, "o_proj", b);
  if (cfg.fused_qkv) {
    s.activation("qkv", {b.batch, b.seq, (hq + 2 * hkv) * d}, qkv);
  } else {
    s.activation("q", {b.batch, b.seq, hq, d}, q);
    s.activation("k", {b.batch, b.seq, hkv, d}, k);
    s.activation("v", {b.batch, b.seq, hkv, d}, v);
  }
  s.activation("att", {b.batch, b.seq, hq, d}, att);
  s.activation("lse", {b.batch, hq, b.seq}, lse);
  s.scratch("datt", {b.batch, b.seq, hq, d}, datt);
  if (cfg.fused_qkv) {
    s.scratch("dqkv", {b.batch, b.seq, (hq + 2 * hkv) * d}, dqkv);
  } else {
    s.scratch("dq", {b.batch, b.seq, hq, d}, dq);
    s.scratch("dk", {b.batch, b.seq, hkv, d}, dk);
    s.scratch("dv", {b.batch, b.seq, hkv, d}, dv);
  }
  if (cfg.rope) {
    s.scratch("rope_cos", {b.seq, d / 2}, rope_cos);
    s.scratch("rope_sin", {b.seq, d / 2}, rope_sin);
  }
}

// q, k, v (and with_grads: dq, dk, dv) for a batch of b sequences of t positions.
attention::views attention::qkv_views(std::int64_t b, std::int64_t t, bool with_grads) const {
  std::int64_t hq = cfg.n_head, hkv = cfg.n_kv_head, d = cfg.head_dim;
  views out;
  if (cfg.fused_qkv) {
    shape fused{b, t, hq + 2 * hkv, d};
    auto split = [&](const tensor& buf, tensor& vq, tensor& vk, tensor& vv) {
      vq = buf.narrow(2, 0, hq);
      vk = buf.narrow(2, hq, hkv);
      vv = buf.narrow(2, hq + hkv, hkv);
    };
    split(planned_view(qkv, fused, label, "qkv"), out.q, out.k, out.v);
    if (with_grads) split(planned_view(dqkv, fused, label, "dqkv"), out.dq, out.dk, out.dv);
  } else {
    out.q = planned_view(q, {b, t, hq, d}, label, "q");
    out.k = planned_view(k, {b, t, hkv, d}, label, "k");
    out.v = planned_view(v, {b, t, hkv, d}, label, "v");
    if (with_grads) {
      out.dq = planned_view(dq, {b, t, hq, d}, label, "dq");
      out.dk = planned_view(dk, {b, t, hkv, d}, label, "dk");
      out.dv = planned_view(dv, {b, t, hkv, d}, label, "dv");
    }
  }
  return out;
}

void attention::rope_tables(std::int64_t t) const {
  TROUPE_CHECK(rope_cos.defined() && t <= rope_cos.size(0), label, ": ", t,
               " positions but the RoPE tables were planned for ",
               rope_cos.defined() ? rope_cos.size(0) : 0);
  std::int64_t half = cfg.head_dim / 2;
  const tensor c = planned_view(rope_cos, {t, half}, label, "rope_cos");
  const tensor s = planned_view(rope_sin, {t, half}, label, "rope_sin");
  if (ring == nullptr) {
    ops::rope_tables(0, rope_options_for(cfg.rope_theta, cfg.rope_scale, cfg.head_dim, t), c, s);
    return;
  }
  // Ring: the local tokens are runs of global positions of a sequence of t x cp tokens.
  const auto options =
      rope_options_for(cfg.rope_theta, cfg.rope_scale, cfg.head_dim, t * ring->degree());
  for (const auto& p : ring->pieces(t))
    ops::rope_tables(p.start, options, c.narrow(0, p.local, p.length),
                     s.narrow(0, p.local, p.length));
}

void attention::forward(const tensor& x, const tensor& y) {
  TROUPE_CHECK(x.defined() && x.dim() == 3 && x.size(2) == cfg.dim, label, ": x must be [B, T, ",
               cfg.dim, "], got ", describe(x));
  TROUPE_CHECK(y.defined() && y.sizes() == x.sizes(), label, ": y must be ", x.sizes().str(),
               " like x, got ", describe(y));
  if (exchange != nullptr) return forward_exchanged(x, y);
  std::int64_t b = x.size(0), t = x.size(1), hq = cfg.n_head, d = cfg.head_dim;
  views w = qkv_views(b, t, false);
  if (cfg.fused_qkv) {
    qkv_proj.forward(x, planned_view(qkv, {b, t, qkv_proj.cfg.out}, label, "qkv"));
  } else {
    q_proj.forward(x, w.q.reshape({b, t, hq * d}));
    k_proj.forward(x, w.k.reshape({b, t, cfg.n_kv_head * d}));
    v_proj.forward(x, w.v.reshape({b, t, cfg.n_kv_head * d}));
  }
  if (cfg.rope) {
    rope_tables(t);
    tensor c = planned_view(rope_cos, {t, d / 2}, label, "rope_cos");
    tensor s = planned_view(rope_sin, {t, d / 2}, label, "rope_sin");
    ops::rope(w.q, c, s, w.q);
    ops::rope(w.k, c, s, w.k);
  }
  tensor a = planned_view(att, {b, t, hq, d}, label, "att");
  if (ring != nullptr) {
    TROUPE_CHECK(!segments.defined(), label,
                 ": packed rows (segments) are not supported under ring context parallelism");
    ring->forward(w.q, w.k, w.v, a, planned_view(lse, {b, hq, t}, label, "lse"), cfg.causal);
  } else {
    ops::attention(w.q, w.k, w.v, a, planned_view(lse, {b, hq, t}, label, "lse"),
                   {.scale = 0.0, .causal = cfg.causal, .segments = segments});
  }
  o_proj.forward(a.reshape({b, t, hq * d}), y);
}

void attention::backward(const tensor& dy, const tensor& dx) {
  TROUPE_CHECK(o_proj.x.defined(), label, ": backward called before forward");
  std::int64_t b = o_proj.x.size(0), t = o_proj.x.size(1), hq = cfg.n_head, d = cfg.head_dim;
  TROUPE_CHECK(dy.defined() && dy.sizes() == shape({b, t, cfg.dim}), label, ": dy must be [", b,
               ", ", t, ", ", cfg.dim, "] like the output, got ", describe(dy));
  if (exchange != nullptr) return backward_exchanged(dy, dx);
  views w = qkv_views(b, t, true);
  tensor da = planned_view(datt, {b, t, hq, d}, label, "datt");
  o_proj.backward(dy, da.reshape({b, t, hq * d}));
  if (ring != nullptr)
    ring->backward(w.q, w.k, w.v, planned_view(att, {b, t, hq, d}, label, "att"),
                   planned_view(lse, {b, hq, t}, label, "lse"), da, w.dq, w.dk, w.dv, cfg.causal);
  else
    ops::attention_backward(w.q, w.k, w.v, planned_view(att, {b, t, hq, d}, label, "att"), da,
                            planned_view(lse, {b, hq, t}, label, "lse"), w.dq, w.dk, w.dv,
                            {.scale = 0.0, .causal = cfg.causal, .segments = segments});
  if (cfg.rope) {  // the saved q, k are rotated: rotate their gradients back
    rope_tables(t);
    tensor c = planned_view(rope_cos, {t, d / 2}, label, "rope_cos");
    tensor s = planned_view(rope_sin, {t, d / 2}, label, "rope_sin");
    ops::rope(w.dq, c, s, w.dq, /*inverse=*/true);
    ops::rope(w.dk, c, s, w.dk, /*inverse=*/true);
  }
  if (cfg.fused_qkv) {
    qkv_proj.backward(planned_view(dqkv, {b, t, qkv_proj.cfg.out}, label, "dqkv"), dx);
  } else {
    std::int64_t hkv = cfg.n_kv_head;
    q_proj.backward(w.dq.reshape({b, t, hq * d}), dx);
    k_proj.backward(w.dk.reshape({b, t, hkv * d}), dx, /*accumulate_dx=*/true);
    v_proj.backward(w.dv.reshape({b, t, hkv * d}), dx, /*accumulate_dx=*/true);
  }
}

}  // namespace troupe::models
