// The arguments both CUDA attention kernels (attention.cu: f32 CUDA cores; attention_mma.cu: bf16
// and f16 tensor cores) take: pointers, the strides of the [B, T, H, D] views, the sizes, the
// scale and the causal mask with offset S - T. Private to tensor/cuda.
#pragma once

#include <cmath>
#include <cstdint>

#include "tensor/cuda/check.cuh"
#include "tensor/ops.hpp"

namespace troupe::cuda::detail {

// Strides in elements of a [B, T, H, D] view with a contiguous last dimension.
struct bthd {
  std::int64_t b = 0, t = 0, h = 0;
  __device__ std::int64_t at(std::int64_t bi, std::int64_t ti, std::int64_t hi) const {
    return bi * b + ti * t + hi * h;
  }
};
inline bthd strides_of(const tensor& x) {
  return {x.stride(0), x.stride(1), x.stride(2)};
}

// T: q, k, v, out and the gradients; L: lse (T or float).
template <class T, class L>
struct attention_args {
  const T* q = nullptr;
  const T* k = nullptr;
  const T* v = nullptr;
  const T* out = nullptr;  // backward: the forward output
  T* out_w = nullptr;      // forward: the output written
  L* lse = nullptr;        // [B, Hq, T]
  const T* dout = nullptr;
  T* dq = nullptr;
  T* dk = nullptr;
  T* dv = nullptr;
  bthd qs, ks, vs, os, dos, dqs, dks, dvs;
  std::int64_t batch = 0, steps = 0, keys = 0, heads = 0, kv_heads = 0;
  int dim = 0;
  float scale = 1;
  bool causal = true;

  __device__ std::int64_t shift() const { return keys - steps; }  // query t sees s <= t + shift
  __device__ bool visible(std::int64_t t, std::int64_t s) const {
    return t < steps && s < keys && (!causal || s <= t + shift());
  }
  // Keys that some query in [t_first, t_last] sees.
  __device__ std::int64_t key_end(std::int64_t t_last) const {
    return causal ? min(keys, t_last + shift() + 1) : keys;
  }
};

// The forward's arguments (the backward adds dout and the gradients). Refuses segment ids, head
// dimensions over max_d and grids past 65535 heads or batches, naming op.
template <class T, class L>
attention_args<T, L> make_attention_args(const char* op, int max_d, const tensor& q,
                                         const tensor& k, const tensor& v, const tensor& out,
                                         const tensor& lse, const ops::attention_options& opt) {
  attention_args<T, L> p;
  p.batch = q.size(0);
  p.steps = q.size(1);
  p.heads = q.size(2);
  p.keys = k.size(1);
  p.kv_heads = k.size(2);
  TROUPE_CHECK(!opt.segments.defined(), "cuda ", op,
               ": segment ids (packed rows) are not supported on CUDA yet; run packed rows on the "
               "CPU or without packing");
  TROUPE_CHECK(q.size(3) <= max_d, "cuda ", op, ": head dimension ", q.size(3), " exceeds ", max_d);
  TROUPE_CHECK(p.heads <= 65535 && p.batch <= 65535, "cuda ", op, ": batch ", p.batch, " or heads ",
               p.heads, " exceed the grid limit 65535");
  p.dim = static_cast<int>(q.size(3));
  p.scale = static_cast<float>(opt.scale != 0.0 ? opt.scale : 1.0 / std::sqrt(double(p.dim)));
  p.causal = opt.causal;
  p.q = ptr<T>(q);
  p.k = ptr<T>(k);
  p.v = ptr<T>(v);
  p.out = ptr<T>(out);
  p.lse = ptr<L>(lse);
  p.qs = strides_of(q);
  p.ks = strides_of(k);
  p.vs = strides_of(v);
  p.os = strides_of(out);
  return p;
}

// Adds the backward's tensors to p.
template <class T, class L>
void add_backward_args(attention_args<T, L>& p, const tensor& dout, const tensor& dq,
                       const tensor& dk, const tensor& dv) {
  p.dout = ptr<T>(dout);
  p.dq = ptr<T>(dq);
  p.dk = ptr<T>(dk);
  p.dv = ptr<T>(dv);
  p.dos = strides_of(dout);
  p.dqs = strides_of(dq);
  p.dks = strides_of(dk);
  p.dvs = strides_of(dv);
}

// Calls f(type_tag<T>, type_tag<L>) with the dtype T of q and the dtype L of lse.
template <class F>
void dispatch_attention(const char* op, const tensor& q, const tensor& lse, F&& f) {
  dispatch_16_32(op, q, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_stat<T>(op, "lse", lse, [&](auto lse_tag) { f(tag, lse_tag); });
  });
}

// The tensor-core kernels (attention_mma.cu), for bf16 and f16 with head dimension 64 or 128 on
// sm_80 and newer: attention_mma_applies says whether attention and attention_backward take them.
bool attention_mma_applies(const tensor& q, const ops::attention_options& opt);
void attention_mma(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                   const tensor& lse, const ops::attention_options& opt);
void attention_mma_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                            const tensor& dout, const tensor& lse, const tensor& dq,
                            const tensor& dk, const tensor& dv, const ops::attention_options& opt);

}  // namespace troupe::cuda::detail
