// kv_cache: planned per-layer key/value storage and the cached attention step (kv_cache.hpp).
#include "models/kv_cache.hpp"

#include <string>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

kv_cache::kv_cache(std::int64_t n_layer, const kv_cache_dims& dims, dtype t, device dev)
    : dims_(dims) {
  TROUPE_CHECK(
      n_layer > 0 && dims.batch > 0 && dims.capacity > 0 && dims.n_kv_head > 0 && dims.head_dim > 0,
      "kv_cache: n_layer, batch, capacity, n_kv_head and head_dim must be > 0, got ", n_layer, ", ",
      dims.batch, ", ", dims.capacity, ", ", dims.n_kv_head, ", ", dims.head_dim);
  layers_.resize(static_cast<std::size_t>(n_layer));  // the slot list points into it: no resizing
  shape s{dims.batch, dims.capacity, dims.n_kv_head, dims.head_dim};
  for (std::int64_t i = 0; i < n_layer; ++i) {
    auto scope = slots_.enter("layers." + std::to_string(i));
    slots_.activation("k", s, layers_[i].k);
    slots_.activation("v", s, layers_[i].v);
  }
  mem_ = layer_memory(slots_, t, dev);
}

void kv_cache::check_room(std::int64_t t, const char* who) const {
  TROUPE_CHECK(t > 0, who, ": a generation step needs at least one new position");
  TROUPE_CHECK(length_ + t <= dims_.capacity, who, ": ", length_, " cached positions plus ", t,
               " new ones exceed the cache capacity ", dims_.capacity);
}

void kv_cache::advance(std::int64_t t) {
  check_room(t, "kv_cache");
  length_ += t;
}

void attention_step(attention& attn, const tensor& x, const tensor& y, const kv_layer& cache,
                    std::int64_t start) {
  const auto& c = attn.cfg;
  const std::string& label = attn.label;
  TROUPE_CHECK(x.defined() && x.dim() == 3 && x.size(2) == c.dim, label, ": x must be [B, t, ",
               c.dim, "], got ", describe(x));
  TROUPE_CHECK(y.defined() && y.sizes() == x.sizes(), label, ": y must be ", x.sizes().str(),
               " like x, got ", describe(y));
  std::int64_t b = x.size(0), t = x.size(1), hq = c.n_head, hkv = c.n_kv_head, d = c.head_dim;
  TROUPE_CHECK(cache.k.defined() && cache.k.dim() == 4 && cache.k.size(0) >= b &&
                   cache.k.size(2) == hkv && cache.k.size(3) == d,
               label, ": the cache must be [>= ", b, ", capacity, ", hkv, ", ", d, "], got ",
               describe(cache.k));
  TROUPE_CHECK(start >= 0 && start + t <= cache.k.size(1), label, ": positions ", start, "..",
               start + t - 1, " do not fit the cache of ", cache.k.size(1));

  // q, k, v of the new positions, in the layer's planned buffers.
  tensor q, k, v;
  if (c.fused_qkv) {
    tensor buf = planned_view(attn.qkv, {b, t, hq + 2 * hkv, d}, label, "qkv");
    attn.qkv_proj.forward(x, buf.reshape({b, t, (hq + 2 * hkv) * d}));
    q = buf.narrow(2, 0, hq);
    k = buf.narrow(2, hq, hkv);
    v = buf.narrow(2, hq + hkv, hkv);
  } else {
    q = planned_view(attn.q, {b, t, hq, d}, label, "q");
    k = planned_view(attn.k, {b, t, hkv, d}, label, "k");
    v = planned_view(attn.v, {b, t, hkv, d}, label, "v");
    attn.q_proj.forward(x, q.reshape({b, t, hq * d}));
    attn.k_proj.forward(x, k.reshape({b, t, hkv * d}));
    attn.v_proj.forward(x, v.reshape({b, t, hkv * d}));
  }
  if (c.rope) {
    tensor cs = planned_view(attn.rope_cos, {t, d / 2}, label, "rope_cos");
    tensor sn = planned_view(attn.rope_sin, {t, d / 2}, label, "rope_sin");
    // Dynamic scaling takes the positions so far, the new ones included (rope_scaling.hpp).
    ops::rope_tables(start, rope_options_for(c.rope_theta, c.rope_scale, d, start + t), cs, sn);
    ops::rope(q, cs, sn, q);
    ops::rope(k, cs, sn, k);
  }
  tensor kc = cache.k.narrow(0, 0, b), vc = cache.v.narrow(0, 0, b);
  ops::copy(k, kc.narrow(1, start, t));
  ops::copy(v, vc.narrow(1, start, t));

  tensor a = planned_view(attn.att, {b, t, hq, d}, label, "att");
  ops::attention(q, kc.narrow(1, 0, start + t), vc.narrow(1, 0, start + t), a,
                 planned_view(attn.lse, {b, hq, t}, label, "lse"),
                 {.scale = 0.0, .causal = c.causal});
  attn.o_proj.forward(a.reshape({b, t, hq * d}), y);
}

}  // namespace troupe::models
