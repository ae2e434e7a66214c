// attention under context parallelism (Ulysses): the projections and o_proj on this rank's T/cp
// positions, the attention core on all T positions of H/cp heads, an all-to-all of the exchange
// (sequence_exchange.hpp) on either side (attention.hpp: `exchange`).
//
// The layer's planned buffers keep their element counts in the other layout: qkv (q, k, v) and
// lse hold the head layout [B, T, H/cp, D] / [B, H/cp, T] (the same numbers of elements as
// [B, T/cp, H, D] / [B, H, T/cp]), att the sequence layout o_proj reads and saves. The exchange
// gives what has no planned slot: the projections' output before the all-to-all, the attention
// output in head layout (kept for backward) and the RoPE tables of all T positions.
//
// GQA with fewer kv heads than ranks (Hkv < cp, cp a multiple of Hkv): the k and v projections'
// outputs are repeated to cp heads (kv head h as heads h * r .. h * r + r - 1, r = cp / Hkv) before
// the exchange, so rank j receives kv head j / r, the one its q heads j Hq/cp .. read; their kept
// copies live in the exchange's kv_heads buffer. Backward sums the r copies' gradients back onto
// each kv head (as repeat_kv's backward does in HF).
//
// Backward is the transpose: o_proj's dx (sequence layout) -> to_heads -> the core's backward ->
// inverse RoPE -> to_sequence -> the projections' backward. RoPE runs after the exchange, on whole
// sequences, so positions are the global ones without an offset.
#include <array>

#include "memory/error.hpp"
#include "models/layers/attention.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {

using buf = sequence_exchange::buffer;

// The three projections' outputs as consecutive pieces of one staging buffer: [B, T/cp, H, D]
// each, H = hq, hkv, hkv.
struct staged {
  tensor q, k, v;
};

staged split_staging(const tensor& stage, std::int64_t b, std::int64_t tl, std::int64_t hq,
                     std::int64_t hkv, std::int64_t d) {
  tensor flat = stage.reshape({stage.numel()});
  const std::int64_t nq = b * tl * hq * d, nkv = b * tl * hkv * d;
  return {flat.narrow(0, 0, nq).reshape({b, tl, hq, d}),
          flat.narrow(0, nq, nkv).reshape({b, tl, hkv, d}),
          flat.narrow(0, nq + nkv, nkv).reshape({b, tl, hkv, d})};
}

// kv head h of x [B, T/cp, Hkv, D] as heads h r .. h r + r - 1 of e [B, T/cp, Hkv r, D].
void repeat_heads(const tensor& x, const tensor& e, std::int64_t r) {
  const tensor e5 = e.reshape({x.size(0), x.size(1), x.size(2), r, x.size(3)});
  for (std::int64_t i = 0; i < r; ++i) ops::copy(x, e5.select(3, i));
}

// Its transpose: dx = the sum of the r copies' gradients (de [B, T/cp, Hkv r, D]); tmp holds at
// least dx's elements.
void sum_repeated_heads(const tensor& de, const tensor& dx, std::int64_t r, const tensor& tmp) {
  const tensor de5 = de.reshape({dx.size(0), dx.size(1), dx.size(2), r, dx.size(3)});
  const tensor t = tmp.reshape({tmp.numel()}).narrow(0, 0, dx.numel()).reshape(dx.sizes());
  ops::copy(de5.select(3, 0), dx);
  for (std::int64_t i = 1; i < r; ++i) {
    ops::copy(de5.select(3, i), t);
    ops::add(dx, t, dx);
  }
}

}  // namespace

void attention::forward_exchanged(const tensor& x, const tensor& y) {
  sequence_exchange& ex = *exchange;
  const int cp = ex.degree();
  const std::int64_t b = x.size(0), tl = x.size(1), t = tl * cp;
  const std::int64_t hq = cfg.n_head, hkv = cfg.n_kv_head, d = cfg.head_dim;
  // n_kv_head < cp: each rank gets one (repeated) kv head.
  const bool repeat_kv = hkv < cp;
  TROUPE_CHECK(cp >= 1 && hq % cp == 0 && (hkv % cp == 0 || cp % hkv == 0), label,
               ": context parallelism over ", cp, " ranks (parallel.cp) needs n_head (", hq,
               ") divisible by it and n_kv_head (", hkv, ") divisible by it or dividing it");
  TROUPE_CHECK(!repeat_kv || !cfg.fused_qkv, label, ": a fused qkv projection needs n_kv_head (",
               hkv, ") divisible by parallel.cp (", cp, ")");
  TROUPE_CHECK(!segments.defined(), label,
               ": packed rows (segments) are not supported under context parallelism");
  const std::int64_t lq = hq / cp, lkv = repeat_kv ? 1 : hkv / cp;
  const tensor stage = ex.get(buf::staging, {b, tl, hq + 2 * hkv, d}, x.type());
  tensor hq_v, hk_v, hv_v;  // this rank's heads over all T positions
  if (cfg.fused_qkv) {
    qkv_proj.forward(x, stage.reshape({b, tl, qkv_proj.cfg.out}));
    const tensor heads =
        planned_view(qkv, {b, tl, qkv_proj.cfg.out}, label, "qkv").reshape({b, t, lq + 2 * lkv, d});
    const std::array<std::int64_t, 3> sections{hq, hkv, hkv};
    ex.to_heads(stage, heads, sections);
    hq_v = heads.narrow(2, 0, lq);
    hk_v = heads.narrow(2, lq, lkv);
    hv_v = heads.narrow(2, lq + lkv, lkv);
  } else {
    const staged s = split_staging(stage, b, tl, hq, hkv, d);
    q_proj.forward(x, s.q.reshape({b, tl, hq * d}));
    k_proj.forward(x, s.k.reshape({b, tl, hkv * d}));
    v_proj.forward(x, s.v.reshape({b, tl, hkv * d}));
    hq_v = planned_view(q, {b, tl, hq, d}, label, "q").reshape({b, t, lq, d});
    const std::array<std::int64_t, 1> sq{hq}, skv{hkv}, scp{cp};
    ex.to_heads(s.q, hq_v, sq);
    if (repeat_kv) {
      const tensor e = ex.get(buf::kv_repeat, {2, b, tl, cp, d}, x.type());
      const tensor kv = ex.get(buf::kv_heads, {2, b, t, 1, d}, x.type());
      hk_v = kv.select(0, 0);
      hv_v = kv.select(0, 1);
      repeat_heads(s.k, e.select(0, 0), cp / hkv);
      repeat_heads(s.v, e.select(0, 1), cp / hkv);
      ex.to_heads(e.select(0, 0), hk_v, scp);
      ex.to_heads(e.select(0, 1), hv_v, scp);
    } else {
      hk_v = planned_view(k, {b, tl, hkv, d}, label, "k").reshape({b, t, lkv, d});
      hv_v = planned_view(v, {b, tl, hkv, d}, label, "v").reshape({b, t, lkv, d});
      ex.to_heads(s.k, hk_v, skv);
      ex.to_heads(s.v, hv_v, skv);
    }
  }
  if (cfg.rope) {
    const tensor c = ex.get(buf::rope_cos, {t, d / 2}, x.type());
    const tensor s = ex.get(buf::rope_sin, {t, d / 2}, x.type());
    ops::rope_tables(0, rope_options_for(cfg.rope_theta, cfg.rope_scale, cfg.head_dim, t), c, s);
    ops::rope(hq_v, c, s, hq_v);
    ops::rope(hk_v, c, s, hk_v);
  }
  const tensor a_heads = ex.get(buf::att_heads, {b, t, lq, d}, x.type());
  const tensor l = planned_view(lse, {b, hq, tl}, label, "lse").reshape({b, lq, t});
  ops::attention(hq_v, hk_v, hv_v, a_heads, l, {.scale = 0.0, .causal = cfg.causal});
  const tensor a = planned_view(att, {b, tl, hq, d}, label, "att");
  const std::array<std::int64_t, 1> sq{hq};
  ex.to_sequence(a_heads, a, sq);
  o_proj.forward(a.reshape({b, tl, hq * d}), y);
}

void attention::backward_exchanged(const tensor& dy, const tensor& dx) {
  sequence_exchange& ex = *exchange;
  const int cp = ex.degree();
  const std::int64_t b = o_proj.x.size(0), tl = o_proj.x.size(1), t = tl * cp;
  const std::int64_t hq = cfg.n_head, hkv = cfg.n_kv_head, d = cfg.head_dim;
  const bool repeat_kv = hkv < cp;  // as in forward
  const std::int64_t lq = hq / cp, lkv = repeat_kv ? 1 : hkv / cp;
  const tensor stage = ex.get(buf::staging, {b, tl, hq + 2 * hkv, d}, dy.type());
  const tensor da = planned_view(datt, {b, tl, hq, d}, label, "datt");
  o_proj.backward(dy, da.reshape({b, tl, hq * d}));
  // d(att) in head layout: the first [B, T, Hq/cp, D] of the staging buffer (free until the
  // gradients of q, k and v go back to the sequence layout, after the core's backward).
  const tensor da_heads =
      stage.reshape({stage.numel()}).narrow(0, 0, b * t * lq * d).reshape({b, t, lq, d});
  const std::array<std::int64_t, 1> sq{hq}, skv{hkv};
  ex.to_heads(da, da_heads, sq);
  tensor hq_v, hk_v, hv_v, dq_v, dk_v, dv_v, dheads;
  if (cfg.fused_qkv) {
    const tensor heads =
        planned_view(qkv, {b, tl, qkv_proj.cfg.out}, label, "qkv").reshape({b, t, lq + 2 * lkv, d});
    dheads = planned_view(dqkv, {b, tl, qkv_proj.cfg.out}, label, "dqkv")
                 .reshape({b, t, lq + 2 * lkv, d});
    hq_v = heads.narrow(2, 0, lq);
    hk_v = heads.narrow(2, lq, lkv);
    hv_v = heads.narrow(2, lq + lkv, lkv);
    dq_v = dheads.narrow(2, 0, lq);
    dk_v = dheads.narrow(2, lq, lkv);
    dv_v = dheads.narrow(2, lq + lkv, lkv);
  } else {
    hq_v = planned_view(q, {b, tl, hq, d}, label, "q").reshape({b, t, lq, d});
    dq_v = planned_view(dq, {b, tl, hq, d}, label, "dq").reshape({b, t, lq, d});
    if (repeat_kv) {
      const tensor kv = ex.get(buf::kv_heads, {2, b, t, 1, d}, dy.type());
      const tensor dkv = ex.get(buf::dkv_heads, {2, b, t, 1, d}, dy.type());
      hk_v = kv.select(0, 0);
      hv_v = kv.select(0, 1);
      dk_v = dkv.select(0, 0);
      dv_v = dkv.select(0, 1);
    } else {
      hk_v = planned_view(k, {b, tl, hkv, d}, label, "k").reshape({b, t, lkv, d});
      hv_v = planned_view(v, {b, tl, hkv, d}, label, "v").reshape({b, t, lkv, d});
      dk_v = planned_view(dk, {b, tl, hkv, d}, label, "dk").reshape({b, t, lkv, d});
      dv_v = planned_view(dv, {b, tl, hkv, d}, label, "dv").reshape({b, t, lkv, d});
    }
  }
  const tensor a_heads = ex.get(buf::att_heads, {b, t, lq, d}, dy.type());
  const tensor l = planned_view(lse, {b, hq, tl}, label, "lse").reshape({b, lq, t});
  ops::attention_backward(hq_v, hk_v, hv_v, a_heads, da_heads, l, dq_v, dk_v, dv_v,
                          {.scale = 0.0, .causal = cfg.causal});
  if (cfg.rope) {  // the saved q, k are rotated: rotate their gradients back
    const tensor c = ex.get(buf::rope_cos, {t, d / 2}, dy.type());
    const tensor s = ex.get(buf::rope_sin, {t, d / 2}, dy.type());
    ops::rope_tables(0, rope_options_for(cfg.rope_theta, cfg.rope_scale, cfg.head_dim, t), c, s);
    ops::rope(dq_v, c, s, dq_v, /*inverse=*/true);
    ops::rope(dk_v, c, s, dk_v, /*inverse=*/true);
  }
  if (cfg.fused_qkv) {
    const std::array<std::int64_t, 3> sections{hq, hkv, hkv};
    ex.to_sequence(dheads, stage, sections);
    qkv_proj.backward(stage.reshape({b, tl, qkv_proj.cfg.out}), dx);
  } else {
    const staged s = split_staging(stage, b, tl, hq, hkv, d);
    ex.to_sequence(dq_v, s.q, sq);
    if (repeat_kv) {
      const std::array<std::int64_t, 1> scp{cp};
      const tensor e = ex.get(buf::kv_repeat, {2, b, tl, cp, d}, dy.type());
      ex.to_sequence(dk_v, e.select(0, 0), scp);
      ex.to_sequence(dv_v, e.select(0, 1), scp);
      // dk_v, dv_v are read: their buffer holds the sums' scratch.
      const tensor scratch = ex.get(buf::dkv_heads, {2, b, t, 1, d}, dy.type());
      sum_repeated_heads(e.select(0, 0), s.k, cp / hkv, scratch);
      sum_repeated_heads(e.select(0, 1), s.v, cp / hkv, scratch);
    } else {
      ex.to_sequence(dk_v, s.k, skv);
      ex.to_sequence(dv_v, s.v, skv);
    }
    q_proj.backward(s.q.reshape({b, tl, hq * d}), dx);
    k_proj.backward(s.k.reshape({b, tl, hkv * d}), dx, /*accumulate_dx=*/true);
    v_proj.backward(s.v.reshape({b, tl, hkv * d}), dx, /*accumulate_dx=*/true);
  }
}

}  // namespace troupe::models
