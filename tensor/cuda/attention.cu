// CUDA attention on CUDA cores for f32, and for bf16 and f16 where the tensor-core kernels of
// attention_mma.cu do not apply (head dimensions other than 64 and 128, GPUs before sm_80, or
// ops::attention_kernel::cuda_cores asked for), head dimension up to 128: a tiled kernel in the
// flash-attention style (the T x S score matrix is never stored) with online softmax, causal
// masking with offset S - T, grouped-query heads and strided q/k/v views.
//
// 16-bit tensors are loaded to f32 (tiles in shared memory are f32), every product and sum is f32,
// and each output or gradient element is rounded once when it is stored. lse is stored in the
// data's dtype or in f32.
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
#include "tensor/cuda/attention_args.cuh"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::attention_args;
using detail::bthd;
using detail::dispatch_attention;
using detail::from_f32;
using detail::to_f32;
using detail::warp_max;
using detail::warp_sum;

constexpr int max_d = 128;
constexpr int dims_per_lane = max_d / 32;
constexpr int tile = 32;        // rows of the other side per shared-memory tile
constexpr int warps = 8;        // rows owned per block
constexpr int pad = max_d + 1;  // padded row: lane j reading row j hits bank (j + d) % 32
constexpr unsigned full_mask = 0xffffffffu;

// Loads rows [r0, r0 + tile) of a [B, *, H, D] view (head h, batch b) into dst[tile][pad], zero
// past `rows`. Called by the whole block.
template <class T>
__device__ void load_tile(float (*dst)[pad], const T* src, bthd st, std::int64_t b, std::int64_t h,
                          std::int64_t r0, std::int64_t rows, int dim) {
  for (int i = threadIdx.x; i < tile * dim; i += blockDim.x) {
    int j = i / dim, d = i % dim;
    std::int64_t r = r0 + j;
    dst[j][d] = r < rows ? to_f32(src[st.at(b, r, h) + d]) : 0.0f;
  }
}

// One block per (query tile of `warps` rows, head, batch).
template <class T, class L>
__global__ void __launch_bounds__(warps * 32) attention_forward_kernel(attention_args<T, L> p) {
  __shared__ float k_tile[tile][pad];
  __shared__ float v_tile[tile][pad];
  __shared__ float q_rows[warps][max_d];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (p.heads / p.kv_heads);
  const std::int64_t t_first = std::int64_t{blockIdx.x} * warps;
  const std::int64_t t = t_first + warp;
  const bool active = t < p.steps;  // the same for the whole warp
  if (active)
    for (int d = lane; d < p.dim; d += 32) q_rows[warp][d] = to_f32(p.q[p.qs.at(b, t, h) + d]);

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
    if (d < p.dim) p.out_w[p.os.at(b, t, h) + d] = from_f32<T>(acc[i] * inv);
  }
  if (lane == 0)
    p.lse[(b * p.heads + h) * p.steps + t] = from_f32<L>(l > 0 ? m + logf(l) : -INFINITY);
}

// dot(dout[t], out[t]) for one query row, reduced over the warp.
template <class T, class L>
__device__ float dout_dot_out(const attention_args<T, L>& p, std::int64_t b, std::int64_t t,
                              std::int64_t h, int lane) {
  float s = 0;
  for (int d = lane; d < p.dim; d += 32)
    s += to_f32(p.dout[p.dos.at(b, t, h) + d]) * to_f32(p.out[p.os.at(b, t, h) + d]);
  return warp_sum(s);
}

// dq[t] = scale * sum_s ds(t, s) k[s], ds = P (dP - D_t), P = exp(scale q.k - lse), dP = dout.v,
// D_t = dout[t].out[t]. One block per (query tile, head, batch), like the forward.
template <class T, class L>
__global__ void __launch_bounds__(warps * 32) attention_dq_kernel(attention_args<T, L> p) {
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
      q_rows[warp][d] = to_f32(p.q[p.qs.at(b, t, h) + d]);
      do_rows[warp][d] = to_f32(p.dout[p.dos.at(b, t, h) + d]);
    }
    lse = to_f32(p.lse[(b * p.heads + h) * p.steps + t]);
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
    if (d < p.dim) p.dq[p.dqs.at(b, t, h) + d] = from_f32<T>(acc[i] * p.scale);
  }
}

// dv[s] = sum over the group's heads and queries of P(t, s) dout[t];
// dk[s] = scale * sum of ds(t, s) q[t]. One block per (key tile of `warps` rows, kv head, batch).
template <class T, class L>
__global__ void __launch_bounds__(warps * 32) attention_dkdv_kernel(attention_args<T, L> p) {
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
      k_rows[warp][d] = to_f32(p.k[p.ks.at(b, s, hk) + d]);
      v_rows[warp][d] = to_f32(p.v[p.vs.at(b, s, hk) + d]);
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
          lse_tile[j] = in ? to_f32(p.lse[(b * p.heads + h) * p.steps + t]) : 0.0f;
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
      p.dk[p.dks.at(b, s, hk) + d] = from_f32<T>(dk[i] * p.scale);
      p.dv[p.dvs.at(b, s, hk) + d] = from_f32<T>(dv[i]);
    }
  }
}

unsigned tiles(std::int64_t rows) {
  return static_cast<unsigned>((rows + warps - 1) / warps);
}

}  // namespace

void attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
               const tensor& lse, const ops::attention_options& opt) {
  if (detail::attention_mma_applies(q, opt)) return detail::attention_mma(q, k, v, out, lse, opt);
  dispatch_attention("attention", q, lse, [&](auto tag, auto lse_tag) {
    using T = typename decltype(tag)::type;
    using L = typename decltype(lse_tag)::type;
    auto p = detail::make_attention_args<T, L>("attention", max_d, q, k, v, out, lse, opt);
    if (p.batch == 0 || p.steps == 0 || p.heads == 0) return;
    p.out_w = detail::ptr<T>(out);
    dim3 grid(tiles(p.steps), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
    attention_forward_kernel<T, L><<<grid, warps * 32>>>(p);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& dout, const tensor& lse, const tensor& dq, const tensor& dk,
                        const tensor& dv, const ops::attention_options& opt) {
  if (detail::attention_mma_applies(q, opt))
    return detail::attention_mma_backward(q, k, v, out, dout, lse, dq, dk, dv, opt);
  dispatch_attention("attention_backward", q, lse, [&](auto tag, auto lse_tag) {
    using T = typename decltype(tag)::type;
    using L = typename decltype(lse_tag)::type;
    auto p = detail::make_attention_args<T, L>("attention_backward", max_d, q, k, v, out, lse, opt);
    if (p.batch == 0 || p.heads == 0) return;
    detail::add_backward_args(p, dout, dq, dk, dv);
    if (p.steps > 0) {
      dim3 grid(tiles(p.steps), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
      attention_dq_kernel<T, L><<<grid, warps * 32>>>(p);
      TROUPE_CUDA_CHECK_LAUNCH();
    }
    if (p.keys > 0) {  // keys no query sees (T = 0) get zero gradients
      dim3 grid(tiles(p.keys), static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
      attention_dkdv_kernel<T, L><<<grid, warps * 32>>>(p);
      TROUPE_CUDA_CHECK_LAUNCH();
    }
  });
}

}  // namespace troupe::cuda
