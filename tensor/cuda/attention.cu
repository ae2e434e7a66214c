// CUDA attention, f32, head dimension up to 128: a tiled kernel in the flash-attention style (the
// T x S score matrix is never stored) with online softmax, causal masking with offset S - T,
// grouped-query heads and strided q/k/v views.
//
// Layout of the work: a warp owns one query row (forward, dq) or one key row (dk, dv); its lanes
// hold the row's output or gradient in registers, 4 dimensions each (d = lane + 32 * i). A block
// of 8 warps streams tiles of 32 rows of the other side through shared memory; lane j of a warp
// scores the pair (its row, tile row j), and the 32 scores are broadcast back with shuffles.
// The backward recomputes the probabilities from the saved log-sum-exp in two kernels, one for dq
// (over keys) and one for dk and dv (over queries and the query heads of the GQA group), so every
// gradient row has one writer: no atomics, the same result on every run, and no zeroing.
#include <cmath>

#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::warp_max;
using detail::warp_sum;

constexpr int max_d = 128;
constexpr int dims_per_lane = max_d / 32;
constexpr int tile = 32;        // rows of the other side per shared-memory tile
constexpr int warps = 8;        // rows owned per block
constexpr int pad = max_d + 1;  // padded row: lane j reading row j hits bank (j + d) % 32
constexpr unsigned full_mask = 0xffffffffu;

// Strides in elements of a [B, T, H, D] view with a contiguous last dimension.
struct bthd {
  std::int64_t b = 0, t = 0, h = 0;
  __device__ std::int64_t at(std::int64_t bi, std::int64_t ti, std::int64_t hi) const {
    return bi * b + ti * t + hi * h;
  }
};
bthd strides_of(const tensor& x) {
  return {x.stride(0), x.stride(1), x.stride(2)};
}

struct attention_args {
  const float* q = nullptr;
  const float* k = nullptr;
  const float* v = nullptr;
  const float* out = nullptr;  // backward: the forward output
  float* out_w = nullptr;      // forward: the output written
  float* lse = nullptr;        // [B, Hq, T]
  const float* dout = nullptr;
  float* dq = nullptr;
  float* dk = nullptr;
  float* dv = nullptr;
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

// Loads rows [r0, r0 + tile) of a [B, *, H, D] view (head h, batch b) into dst[tile][pad], zero
// past `rows`. Called by the whole block.
__device__ void load_tile(float (*dst)[pad], const float* src, bthd st, std::int64_t b,
                          std::int64_t h, std::int64_t r0, std::int64_t rows, int dim) {
  for (int i = threadIdx.x; i < tile * dim; i += blockDim.x) {
    int j = i / dim, d = i % dim;
    std::int64_t r = r0 + j;
    dst[j][d] = r < rows ? src[st.at(b, r, h) + d] : 0.0f;
  }
}

// One block per (query tile of `warps` rows, head, batch).
__global__ void __launch_bounds__(warps * 32) attention_forward_kernel(attention_args p) {
  __shared__ float k_tile[tile][pad];
  __shared__ float v_tile[tile][pad];
  __shared__ float q_rows[warps][max_d];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (p.heads / p.kv_heads);
  const std::int64_t t_first = std::int64_t{blockIdx.x} * warps;
  const std::int64_t t = t_first + warp;
  const bool active = t < p.steps;  // the same for the whole warp
  if (active)
    for (int d = lane; d < p.dim; d += 32) q_rows[warp][d] = p.q[p.qs.at(b, t, h) + d];

  float m = -INFINITY, l = 0, acc[dims_per_lane] = {};
  const std::int64_t s_end = p.key_end(min(t_first + warps, p.steps) - 1);
  for (std::int64_t s0 = 0; s0 < s_end; s0 += tile) {
    __syncthreads();  // the previous tile is consumed (first pass: q_rows is written)
    load_tile(k_tile, p.k, p.ks, b, hk, s0, p.keys, p.dim);
    load_tile(v_tile, p.v, p.vs, b, hk, s0, p.keys, p.dim);
    __syncthreads();
    if (!active) continue;
    const std::int64_t s = s0 + lane;
    const bool ok = p.visible(t, s);
    float score = -INFINITY;
    if (ok) {
      float dot = 0;
      for (int d = 0; d < p.dim; ++d) dot += q_rows[warp][d] * k_tile[lane][d];
      score = dot * p.scale;
    }
    const float m_new = fmaxf(m, warp_max(score));
    if (m_new == -INFINITY) continue;          // nothing visible yet (warp-uniform)
    const float correction = expf(m - m_new);  // 0 while m is -inf
    const float prob = ok ? expf(score - m_new) : 0.0f;
    l = l * correction + warp_sum(prob);
#pragma unroll
    for (int i = 0; i < dims_per_lane; ++i) acc[i] *= correction;
    for (int j = 0; j < tile; ++j) {
      const float pj = __shfl_sync(full_mask, prob, j);
#pragma unroll
      for (int i = 0; i < dims_per_lane; ++i) {
        const int d = lane + 32 * i;
        if (d < p.dim) acc[i] += pj * v_tile[j][d];
      }
    }
    m = m_new;
  }
  if (!active) return;
  const float inv = l > 0 ? 1.0f / l : 0.0f;
#pragma unroll
  for (int i = 0; i < dims_per_lane; ++i) {
    const int d = lane + 32 * i;
    if (d < p.dim) p.out_w[p.os.at(b, t, h) + d] = acc[i] * inv;
  }
  if (lane == 0) p.lse[(b * p.heads + h) * p.steps + t] = l > 0 ? m + logf(l) : -INFINITY;
}

// dot(dout[t], out[t]) for one query row, reduced over the warp.
__device__ float dout_dot_out(const attention_args& p, std::int64_t b, std::int64_t t,
                              std::int64_t h, int lane) {
  float s = 0;
  for (int d = lane; d < p.dim; d += 32)
    s += p.dout[p.dos.at(b, t, h) + d] * p.out[p.os.at(b, t, h) + d];
  return warp_sum(s);
}

// dq[t] = scale * sum_s ds(t, s) k[s], ds = P (dP - D_t), P = exp(scale q.k - lse), dP = dout.v,
// D_t = dout[t].out[t]. One block per (query tile, head, batch), like the forward.
__global__ void __launch_bounds__(warps * 32) attention_dq_kernel(attention_args p) {
  __shared__ float k_tile[tile][pad];
  __shared__ float v_tile[tile][pad];
  __shared__ float q_rows[warps][max_d];
  __shared__ float do_rows[warps][max_d];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (p.heads / p.kv_heads);
  const std::int64_t t_first = std::int64_t{blockIdx.x} * warps;
  const std::int64_t t = t_first + warp;
  const bool active = t < p.steps;
  float lse = 0, delta = 0;
  if (active) {
    for (int d = lane; d < p.dim; d += 32) {
      q_rows[warp][d] = p.q[p.qs.at(b, t, h) + d];
      do_rows[warp][d] = p.dout[p.dos.at(b, t, h) + d];
    }
    lse = p.lse[(b * p.heads + h) * p.steps + t];
    delta = dout_dot_out(p, b, t, h, lane);
  }

  float acc[dims_per_lane] = {};
  const std::int64_t s_end = p.key_end(min(t_first + warps, p.steps) - 1);
  for (std::int64_t s0 = 0; s0 < s_end; s0 += tile) {
    __syncthreads();
    load_tile(k_tile, p.k, p.ks, b, hk, s0, p.keys, p.dim);
    load_tile(v_tile, p.v, p.vs, b, hk, s0, p.keys, p.dim);
    __syncthreads();
    if (!active) continue;
    const std::int64_t s = s0 + lane;
    float ds = 0;
    if (p.visible(t, s)) {
      float qk = 0, dp = 0;
      for (int d = 0; d < p.dim; ++d) {
        qk += q_rows[warp][d] * k_tile[lane][d];
        dp += do_rows[warp][d] * v_tile[lane][d];
      }
      ds = expf(qk * p.scale - lse) * (dp - delta);
    }
    for (int j = 0; j < tile; ++j) {
      const float dsj = __shfl_sync(full_mask, ds, j);
#pragma unroll
      for (int i = 0; i < dims_per_lane; ++i) {
        const int d = lane + 32 * i;
        if (d < p.dim) acc[i] += dsj * k_tile[j][d];
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int i = 0; i < dims_per_lane; ++i) {
    const int d = lane + 32 * i;
    if (d < p.dim) p.dq[p.dqs.at(b, t, h) + d] = acc[i] * p.scale;
  }
}

// dv[s] = sum over the group's heads and queries of P(t, s) dout[t];
// dk[s] = scale * sum of ds(t, s) q[t]. One block per (key tile of `warps` rows, kv head, batch).
__global__ void __launch_bounds__(warps * 32) attention_dkdv_kernel(attention_args p) {
  __shared__ float q_tile[tile][pad];
  __shared__ float do_tile[tile][pad];
  __shared__ float k_rows[warps][max_d];
  __shared__ float v_rows[warps][max_d];
  __shared__ float lse_tile[tile];
  __shared__ float delta_tile[tile];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t b = blockIdx.z, hk = blockIdx.y, group = p.heads / p.kv_heads;
  const std::int64_t s_first = std::int64_t{blockIdx.x} * warps;
  const std::int64_t s = s_first + warp;
  const bool active = s < p.keys;
  if (active)
    for (int d = lane; d < p.dim; d += 32) {
      k_rows[warp][d] = p.k[p.ks.at(b, s, hk) + d];
      v_rows[warp][d] = p.v[p.vs.at(b, s, hk) + d];
    }

  float dk[dims_per_lane] = {}, dv[dims_per_lane] = {};
  // Queries before t_begin see none of this block's keys.
  const std::int64_t t_begin = p.causal ? max(std::int64_t{0}, s_first - (p.keys - p.steps)) : 0;
  for (std::int64_t g = 0; g < group; ++g) {
    const std::int64_t h = hk * group + g;
    for (std::int64_t t0 = t_begin; t0 < p.steps; t0 += tile) {
      __syncthreads();  // the previous tile is consumed (first pass: k_rows, v_rows are written)
      load_tile(q_tile, p.q, p.qs, b, h, t0, p.steps, p.dim);
      load_tile(do_tile, p.dout, p.dos, b, h, t0, p.steps, p.dim);
      for (int j = warp; j < tile; j += warps) {  // a warp per query row
        const std::int64_t t = t0 + j;
        const bool in = t < p.steps;  // the same for the whole warp
        const float delta = in ? dout_dot_out(p, b, t, h, lane) : 0.0f;
        if (lane == 0) {
          delta_tile[j] = delta;
          lse_tile[j] = in ? p.lse[(b * p.heads + h) * p.steps + t] : 0.0f;
        }
      }
      __syncthreads();
      if (!active) continue;
      const std::int64_t t = t0 + lane;
      float prob = 0, ds = 0;
      if (p.visible(t, s)) {
        float qk = 0, dp = 0;
        for (int d = 0; d < p.dim; ++d) {
          qk += q_tile[lane][d] * k_rows[warp][d];
          dp += do_tile[lane][d] * v_rows[warp][d];
        }
        prob = expf(qk * p.scale - lse_tile[lane]);
        ds = prob * (dp - delta_tile[lane]);
      }
      for (int j = 0; j < tile; ++j) {
        const float pj = __shfl_sync(full_mask, prob, j);
        const float dsj = __shfl_sync(full_mask, ds, j);
#pragma unroll
        for (int i = 0; i < dims_per_lane; ++i) {
          const int d = lane + 32 * i;
          if (d < p.dim) {
            dv[i] += pj * do_tile[j][d];
            dk[i] += dsj * q_tile[j][d];
          }
        }
      }
    }
  }
  if (!active) return;
#pragma unroll
  for (int i = 0; i < dims_per_lane; ++i) {
    const int d = lane + 32 * i;
    if (d < p.dim) {
      p.dk[p.dks.at(b, s, hk) + d] = dk[i] * p.scale;
      p.dv[p.dvs.at(b, s, hk) + d] = dv[i];
    }
  }
}

attention_args make_args(const char* op, const tensor& q, const tensor& k, const tensor& v,
                         const tensor& out, const tensor& lse, const ops::attention_options& opt) {
  detail::need_f32(op, q);
  attention_args p;
  p.batch = q.size(0);
  p.steps = q.size(1);
  p.heads = q.size(2);
  p.keys = k.size(1);
  p.kv_heads = k.size(2);
  TROUPE_CHECK(q.size(3) <= max_d, "cuda ", op, ": head dimension ", q.size(3), " exceeds ", max_d);
  TROUPE_CHECK(p.heads <= 65535 && p.batch <= 65535, "cuda ", op, ": batch ", p.batch, " or heads ",
               p.heads, " exceed the grid limit 65535");
  p.dim = static_cast<int>(q.size(3));
  p.scale = static_cast<float>(opt.scale != 0.0 ? opt.scale : 1.0 / std::sqrt(double(p.dim)));
  p.causal = opt.causal;
  p.q = detail::ptr<float>(q);
  p.k = detail::ptr<float>(k);
  p.v = detail::ptr<float>(v);
  p.out = detail::ptr<float>(out);
  p.lse = detail::ptr<float>(lse);
  p.qs = strides_of(q);
  p.ks = strides_of(k);
  p.vs = strides_of(v);
  p.os = strides_of(out);
  return p;
}

unsigned tiles(std::int64_t rows) {
  return static_cast<unsigned>((rows + warps - 1) / warps);
}

}  // namespace

void attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
               const tensor& lse, const ops::attention_options& opt) {
  attention_args p = make_args("attention", q, k, v, out, lse, opt);
  if (p.batch == 0 || p.steps == 0 || p.heads == 0) return;
  p.out_w = detail::ptr<float>(out);
  dim3 grid(tiles(p.steps), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
  attention_forward_kernel<<<grid, warps * 32>>>(p);
  TROUPE_CUDA_CHECK_LAUNCH();
}

void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& dout, const tensor& lse, const tensor& dq, const tensor& dk,
                        const tensor& dv, const ops::attention_options& opt) {
  attention_args p = make_args("attention_backward", q, k, v, out, lse, opt);
  if (p.batch == 0 || p.heads == 0) return;
  p.dout = detail::ptr<float>(dout);
  p.dq = detail::ptr<float>(dq);
  p.dk = detail::ptr<float>(dk);
  p.dv = detail::ptr<float>(dv);
  p.dos = strides_of(dout);
  p.dqs = strides_of(dq);
  p.dks = strides_of(dk);
  p.dvs = strides_of(dv);
  if (p.steps > 0) {
    dim3 grid(tiles(p.steps), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
    attention_dq_kernel<<<grid, warps * 32>>>(p);
    TROUPE_CUDA_CHECK_LAUNCH();
  }
  if (p.keys > 0) {  // keys no query sees (T = 0) get zero gradients
    dim3 grid(tiles(p.keys), static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
    attention_dkdv_kernel<<<grid, warps * 32>>>(p);
    TROUPE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace troupe::cuda
