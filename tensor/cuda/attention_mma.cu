// Tensor-core attention for bf16 and f16 with head dimension 64 or 128 on sm_80 and newer, in the
// FlashAttention-2 style: the same contract as attention.cu (online softmax with the log-sum-exp
// saved in the data's dtype or f32, causal masking with offset S - T, grouped-query heads, strided
// q/k/v views with a contiguous last dimension), but every matrix product runs on tensor cores
// through the WMMA API (nvcuda::wmma, 16x16x16 fragments of T with f32 accumulators).
//
// Work layout. A block has 4 warps; a warp owns 16 rows of its side (query rows in the forward
// and dq kernels, key rows in the dk/dv kernel), so a block owns 64 rows. The block streams tiles
// of 64 rows of the other side through shared memory as T ([64][D + 8]: 16 bytes of padding per
// row against bank conflicts, and every fragment pointer stays 32-byte aligned as WMMA needs).
// Per tile a warp computes its 16 x 64 scores S = Q K^T with WMMA into an f32 scratch in shared
// memory, where its lanes (two per row, 32 columns each) apply scale, mask and softmax in f32;
// the products that take probabilities then read them from shared memory as T.
//
// Forward: per key tile, S = Q K^T (f32), m_new = max(m, rowmax S), P = exp(S - m_new) in f32,
// l = l exp(m - m_new) + rowsum P (of the f32 P), P rounded to T, P V on tensor cores into the
// scratch, and the lanes' f32 output rows (in registers: D / 2 values per lane) become
// O exp(m - m_new) + P V. At the end O / l is rounded once to T, lse = m + log l.
//
// Backward (recomputing P from the lse, as FlashAttention-2 does): a small kernel forms
// delta_t = dot(dout[t], out[t]) in f32 once per query row; then, as in attention.cu, one kernel
// per query tile for dq (over key tiles: S = Q K^T, dP = dout V^T, dS = P (dP - delta) in f32,
// rounded to T, dq += dS K) and one per key tile for dk and dv (over the query heads of the GQA
// group and their query tiles: S^T = K Q^T, dP^T = V dout^T, P^T and dS^T rounded to T,
// dv += P^T dout, dk += dS^T Q). Every gradient row has one writer: no atomics, the same result on
// every run, nothing to zero. The accumulators stay in WMMA fragments (f32) until the end, where
// they are scaled, staged through shared memory and rounded once to T.
//
// What is rounded besides the outputs (as in FlashAttention): the probabilities P before P V and
// P^T dout, and dS before dS K and dS^T Q, each once to T (relative error at most half a 16-bit
// ulp, plus half of f16's subnormal spacing). Scores, dP, softmax statistics and all sums are f32.
// The tests' bounds (tensor/cuda/attention_mma.test.cpp) add exactly these roundings to the f32
// kernel's.
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "tensor/backend.hpp"
#include "tensor/cuda/attention_args.cuh"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

namespace wmma = nvcuda::wmma;
using detail::attention_args;
using detail::bthd;
using detail::from_f32;
using detail::to_f32;

constexpr int warps = 4;
constexpr int frag = 16;                  // WMMA's tile: 16 x 16 x 16
constexpr int warp_rows = frag;           // rows of its side a warp owns
constexpr int block_rows = warps * frag;  // rows of its side a block owns
constexpr int tile = 64;                  // rows of the other side per shared-memory tile
constexpr int ld_tile = tile + 8;         // leading dimension of a warp's [16][tile] T tile
constexpr int ld_f32 = tile + 4;          // leading dimension of a warp's [16][tile] f32 tile
constexpr unsigned full_mask = 0xffffffffu;

template <class T>
using frag_a = wmma::fragment<wmma::matrix_a, frag, frag, frag, T, wmma::row_major>;
template <class T, class Layout>
using frag_b = wmma::fragment<wmma::matrix_b, frag, frag, frag, T, Layout>;
using frag_acc = wmma::fragment<wmma::accumulator, frag, frag, frag, float>;

// Shared-memory layout of the kernels for head dimension D, in bytes. Every region is a multiple
// of 128 bytes, so every region starts 128-byte aligned.
template <int D>
struct smem_layout {
  static_assert(D % frag == 0 && D >= tile, "D must be a multiple of 16, at least the tile");
  static constexpr int ld_rows = D + 8;  // a [rows][D] T tile
  static constexpr int ld_out = D + 4;   // a [16][D] f32 tile (a warp's P V, or its results)
  static constexpr std::size_t rows_tile = std::size_t{tile} * ld_rows * 2;  // [64][D] T
  // A warp's f32 scratch: the forward's scores then P V ([16][D] f32); the backward's S and dP
  // ([2][16][tile] f32) then its results ([16][D] f32). Its first bytes also stage the warp's own
  // 16 rows as T ([16][D + 8]) before they become fragments.
  static constexpr std::size_t fwd_scratch = std::size_t{frag} * ld_out * 4;
  static constexpr std::size_t bwd_scratch = std::size_t{2} * frag * ld_f32 * 4;
  static constexpr std::size_t t_tile = std::size_t{frag} * ld_tile * 2;  // a warp's [16][64] T
  static constexpr std::size_t forward = 2 * rows_tile + warps * (fwd_scratch + t_tile);
  static constexpr std::size_t dq = 2 * rows_tile + warps * (bwd_scratch + t_tile);
  // dk/dv: Q and dout tiles, per warp the scratch and the P^T and dS^T tiles, lse and delta.
  static constexpr std::size_t dkdv =
      2 * rows_tile + warps * (bwd_scratch + 2 * t_tile) + 2 * tile * 4;
  static_assert(rows_tile % 128 == 0 && fwd_scratch % 128 == 0 && bwd_scratch % 128 == 0 &&
                t_tile % 128 == 0);
  static_assert(std::size_t{frag} * ld_rows * 2 <= fwd_scratch &&
                    std::size_t{frag} * ld_rows * 2 <= bwd_scratch &&
                    std::size_t{frag} * ld_out * 4 <= bwd_scratch,
                "a warp's scratch must hold its staged rows and its results");
};

// Copies rows [r0, r0 + n) of the (b, h) slice of a [B, *, H, D] view into dst[n][ld] (T), zero
// past `rows`; threads tid, tid + threads, ... share the work in 16-byte chunks. vec: every row
// start is 16-byte aligned (else the chunks are copied elementwise).
template <class T, int D>
__device__ void load_rows(T* dst, int ld, const T* src, bthd st, std::int64_t b, std::int64_t h,
                          std::int64_t r0, std::int64_t rows, int n, bool vec, int tid,
                          int threads) {
  constexpr int chunks = D / 8;
  for (int i = tid; i < n * chunks; i += threads) {
    const int j = i / chunks, c = (i % chunks) * 8;
    const std::int64_t r = r0 + j;
    T* d = dst + j * ld + c;
    if (r >= rows) {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);  // +0 in bf16 and f16
    } else if (vec) {
      *reinterpret_cast<uint4*>(d) = *reinterpret_cast<const uint4*>(src + st.at(b, r, h) + c);
    } else {
      const T* s = src + st.at(b, r, h) + c;
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] = s[e];
    }
  }
}

// The warp's 16 rows [r0, r0 + 16) of a view as A fragments (row-major, D / 16 of them), staged
// through the warp's scratch (free before and after).
template <class T, int D>
__device__ void load_row_fragments(frag_a<T> (&f)[D / frag], void* scratch, const T* src, bthd st,
                                   std::int64_t b, std::int64_t h, std::int64_t r0,
                                   std::int64_t rows, bool vec, int lane) {
  constexpr int ld = smem_layout<D>::ld_rows;
  T* stage = static_cast<T*>(scratch);
  load_rows<T, D>(stage, ld, src, st, b, h, r0, rows, frag, vec, lane, 32);
  __syncwarp();
#pragma unroll
  for (int kk = 0; kk < D / frag; ++kk) wmma::load_matrix_sync(f[kk], stage + kk * frag, ld);
  __syncwarp();
}

// Writes the warp's f32 results out[16][D] (ld_out, in shared memory) rounded to T into rows
// [r0, r0 + 16) of a view, rows below `rows` only; lanes 2r and 2r + 1 write halves of row r.
template <class T, int D>
__device__ void store_rows(const float* out, T* dst, bthd st, std::int64_t b, std::int64_t h,
                           std::int64_t r0, std::int64_t rows, int lane) {
  const int row = lane >> 1, half = lane & 1;
  const std::int64_t r = r0 + row;
  if (r >= rows) return;
  const float* o = out + row * smem_layout<D>::ld_out + half * (D / 2);
  T* d = dst + st.at(b, r, h) + half * (D / 2);
#pragma unroll 8
  for (int i = 0; i < D / 2; ++i) d[i] = from_f32<T>(o[i]);
}

// Scales the accumulators and writes them through the warp's scratch as rows [r0, r0 + 16).
template <class T, int D>
__device__ void store_fragments(frag_acc (&acc)[D / frag], float scale, float* scratch, T* dst,
                                bthd st, std::int64_t b, std::int64_t h, std::int64_t r0,
                                std::int64_t rows, int lane) {
#pragma unroll
  for (int dn = 0; dn < D / frag; ++dn) {
    for (int i = 0; i < acc[dn].num_elements; ++i) acc[dn].x[i] *= scale;
    wmma::store_matrix_sync(scratch + dn * frag, acc[dn], smem_layout<D>::ld_out,
                            wmma::mem_row_major);
  }
  __syncwarp();
  store_rows<T, D>(scratch, dst, st, b, h, r0, rows, lane);
  __syncwarp();
}

struct launch_extra {
  bool vec = false;  // every row of q, k, v, out, dout (and dq, dk, dv) is 16-byte aligned
  const float* delta = nullptr;  // backward: [B, Hq, T] dot(dout, out) per query row
};

// One block per (64 query rows, head, batch).
template <class T, class L, int D>
__global__ void __launch_bounds__(warps * 32)
    mma_forward_kernel(attention_args<T, L> p, launch_extra x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using sm = smem_layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T* k_tile = reinterpret_cast<T*>(smem);
  T* v_tile = reinterpret_cast<T*>(smem + sm::rows_tile);
  float* scratch = reinterpret_cast<float*>(smem + 2 * sm::rows_tile + warp * sm::fwd_scratch);
  T* p_tile =
      reinterpret_cast<T*>(smem + 2 * sm::rows_tile + warps * sm::fwd_scratch + warp * sm::t_tile);
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (p.heads / p.kv_heads);
  const std::int64_t t_block = std::int64_t{blockIdx.x} * block_rows;
  const std::int64_t t_warp = t_block + warp * warp_rows;

  frag_a<T> qf[D / frag];
  load_row_fragments<T, D>(qf, scratch, p.q, p.qs, b, h, t_warp, p.steps, x.vec, lane);

  // Lanes 2r and 2r + 1 keep row r's statistics (both hold them) and half of its output each.
  const int row = lane >> 1, half = lane & 1;
  const std::int64_t t = t_warp + row;
  float m = -INFINITY, l = 0, o[D / 2];
#pragma unroll
  for (int i = 0; i < D / 2; ++i) o[i] = 0;
  const std::int64_t s_end = p.key_end(min(t_block + block_rows, p.steps) - 1);
  for (std::int64_t s0 = 0; s0 < s_end; s0 += tile) {
    __syncthreads();  // every warp is done with the previous K and V tiles and its scratch
    load_rows<T, D>(k_tile, sm::ld_rows, p.k, p.ks, b, hk, s0, p.keys, tile, x.vec, threadIdx.x,
                    blockDim.x);
    load_rows<T, D>(v_tile, sm::ld_rows, p.v, p.vs, b, hk, s0, p.keys, tile, x.vec, threadIdx.x,
                    blockDim.x);
    __syncthreads();

    // S = Q K^T: K^T [D][64] is K's [64][D] tile read column-major.
#pragma unroll
    for (int n = 0; n < tile / frag; ++n) {
      frag_acc acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D / frag; ++kk) {
        frag_b<T, wmma::col_major> kf;
        wmma::load_matrix_sync(kf, k_tile + n * frag * sm::ld_rows + kk * frag, sm::ld_rows);
        wmma::mma_sync(acc, qf[kk], kf, acc);
      }
      wmma::store_matrix_sync(scratch + n * frag, acc, ld_f32, wmma::mem_row_major);
    }
    __syncwarp();

    // Online softmax on the lane's half row: 32 scores.
    const float* srow = scratch + row * ld_f32 + half * (tile / 2);
    const std::int64_t s_lane = s0 + half * (tile / 2);
    float mx = -INFINITY;
    for (int j = 0; j < tile / 2; ++j)
      if (p.visible(t, s_lane + j)) mx = fmaxf(mx, srow[j] * p.scale);
    mx = fmaxf(mx, __shfl_xor_sync(full_mask, mx, 1));
    const float m_new = fmaxf(m, mx);
    // 0 while nothing was seen (m = -inf); 1 if nothing is seen yet (all is still 0)
    const float correction = m_new == -INFINITY ? 1.0f : expf(m - m_new);
    T* prow = p_tile + row * ld_tile + half * (tile / 2);
    float sum = 0;
    for (int j = 0; j < tile / 2; ++j) {
      const float e =
          m_new != -INFINITY && p.visible(t, s_lane + j) ? expf(srow[j] * p.scale - m_new) : 0.0f;
      sum += e;
      prow[j] = from_f32<T>(e);
    }
    sum += __shfl_xor_sync(full_mask, sum, 1);
    l = l * correction + sum;
    m = m_new;
    __syncwarp();  // P is written and S is read: the scratch takes P V

    // P V: P [16][64] from the T tile, V's [64][D] tile row-major.
#pragma unroll
    for (int dn = 0; dn < D / frag; ++dn) {
      frag_acc acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < tile / frag; ++kk) {
        frag_a<T> pf;
        frag_b<T, wmma::row_major> vf;
        wmma::load_matrix_sync(pf, p_tile + kk * frag, ld_tile);
        wmma::load_matrix_sync(vf, v_tile + kk * frag * sm::ld_rows + dn * frag, sm::ld_rows);
        wmma::mma_sync(acc, pf, vf, acc);
      }
      wmma::store_matrix_sync(scratch + dn * frag, acc, sm::ld_out, wmma::mem_row_major);
    }
    __syncwarp();
    const float* pv = scratch + row * sm::ld_out + half * (D / 2);
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o[i] = o[i] * correction + pv[i];
  }
  if (t >= p.steps) return;
  const float inv = l > 0 ? 1.0f / l : 0.0f;
  T* dst = p.out_w + p.os.at(b, t, h) + half * (D / 2);
#pragma unroll  // fully: o stays in registers
  for (int i = 0; i < D / 2; ++i) dst[i] = from_f32<T>(o[i] * inv);
  if (half == 0)
    p.lse[(b * p.heads + h) * p.steps + t] = from_f32<L>(l > 0 ? m + logf(l) : -INFINITY);
#endif
}

// delta[(b * Hq + h) * T + t] = dot(dout[b, t, h], out[b, t, h]) in f32: a warp per query row.
template <class T, class L>
__global__ void __launch_bounds__(256) mma_delta_kernel(attention_args<T, L> p, float* delta) {
  const int lane = threadIdx.x & 31;
  const std::int64_t rows = p.batch * p.heads * p.steps;
  const std::int64_t warps_total = std::int64_t{gridDim.x} * (blockDim.x >> 5);
  for (std::int64_t r = (std::int64_t{blockIdx.x} * blockDim.x + threadIdx.x) >> 5; r < rows;
       r += warps_total) {
    const std::int64_t t = r % p.steps, h = (r / p.steps) % p.heads, b = r / (p.steps * p.heads);
    float s = 0;
    for (int d = lane; d < p.dim; d += 32)
      s += to_f32(p.dout[p.dos.at(b, t, h) + d]) * to_f32(p.out[p.os.at(b, t, h) + d]);
    s = detail::warp_sum(s);
    if (lane == 0) delta[r] = s;
  }
}

// dq = scale dS K with dS = P (dP - delta), P = exp(scale Q K^T - lse), dP = dout V^T. One block
// per (64 query rows, head, batch), like the forward.
template <class T, class L, int D>
__global__ void __launch_bounds__(warps * 32)
    mma_dq_kernel(attention_args<T, L> p, launch_extra x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using sm = smem_layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T* k_tile = reinterpret_cast<T*>(smem);
  T* v_tile = reinterpret_cast<T*>(smem + sm::rows_tile);
  float* s_f32 = reinterpret_cast<float*>(smem + 2 * sm::rows_tile + warp * sm::bwd_scratch);
  float* dp_f32 = s_f32 + frag * ld_f32;
  T* ds_tile =
      reinterpret_cast<T*>(smem + 2 * sm::rows_tile + warps * sm::bwd_scratch + warp * sm::t_tile);
  const std::int64_t b = blockIdx.z, h = blockIdx.y, hk = h / (p.heads / p.kv_heads);
  const std::int64_t t_block = std::int64_t{blockIdx.x} * block_rows;
  const std::int64_t t_warp = t_block + warp * warp_rows;

  frag_a<T> qf[D / frag], dof[D / frag];
  load_row_fragments<T, D>(qf, s_f32, p.q, p.qs, b, h, t_warp, p.steps, x.vec, lane);
  load_row_fragments<T, D>(dof, s_f32, p.dout, p.dos, b, h, t_warp, p.steps, x.vec, lane);
  frag_acc dq[D / frag];
#pragma unroll
  for (int dn = 0; dn < D / frag; ++dn) wmma::fill_fragment(dq[dn], 0.0f);

  const int row = lane >> 1, half = lane & 1;
  const std::int64_t t = t_warp + row;
  const bool in = t < p.steps;
  const float lse = in ? to_f32(p.lse[(b * p.heads + h) * p.steps + t]) : 0.0f;
  const float delta = in ? x.delta[(b * p.heads + h) * p.steps + t] : 0.0f;
  const std::int64_t s_end = p.key_end(min(t_block + block_rows, p.steps) - 1);
  for (std::int64_t s0 = 0; s0 < s_end; s0 += tile) {
    __syncthreads();
    load_rows<T, D>(k_tile, sm::ld_rows, p.k, p.ks, b, hk, s0, p.keys, tile, x.vec, threadIdx.x,
                    blockDim.x);
    load_rows<T, D>(v_tile, sm::ld_rows, p.v, p.vs, b, hk, s0, p.keys, tile, x.vec, threadIdx.x,
                    blockDim.x);
    __syncthreads();

    // S = Q K^T and dP = dout V^T ([16][64] f32 each).
#pragma unroll
    for (int n = 0; n < tile / frag; ++n) {
      frag_acc s_acc, dp_acc;
      wmma::fill_fragment(s_acc, 0.0f);
      wmma::fill_fragment(dp_acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D / frag; ++kk) {
        frag_b<T, wmma::col_major> kf, vf;
        wmma::load_matrix_sync(kf, k_tile + n * frag * sm::ld_rows + kk * frag, sm::ld_rows);
        wmma::load_matrix_sync(vf, v_tile + n * frag * sm::ld_rows + kk * frag, sm::ld_rows);
        wmma::mma_sync(s_acc, qf[kk], kf, s_acc);
        wmma::mma_sync(dp_acc, dof[kk], vf, dp_acc);
      }
      wmma::store_matrix_sync(s_f32 + n * frag, s_acc, ld_f32, wmma::mem_row_major);
      wmma::store_matrix_sync(dp_f32 + n * frag, dp_acc, ld_f32, wmma::mem_row_major);
    }
    __syncwarp();

    // dS in f32, rounded once to T.
    const int c0 = half * (tile / 2);
    for (int j = 0; j < tile / 2; ++j) {
      const int c = c0 + j;
      float ds = 0;
      if (p.visible(t, s0 + c))
        ds = expf(s_f32[row * ld_f32 + c] * p.scale - lse) * (dp_f32[row * ld_f32 + c] - delta);
      ds_tile[row * ld_tile + c] = from_f32<T>(ds);
    }
    __syncwarp();

    // dq += dS K: dS [16][64], K's [64][D] tile row-major.
#pragma unroll
    for (int dn = 0; dn < D / frag; ++dn) {
#pragma unroll
      for (int kk = 0; kk < tile / frag; ++kk) {
        frag_a<T> dsf;
        frag_b<T, wmma::row_major> kf;
        wmma::load_matrix_sync(dsf, ds_tile + kk * frag, ld_tile);
        wmma::load_matrix_sync(kf, k_tile + kk * frag * sm::ld_rows + dn * frag, sm::ld_rows);
        wmma::mma_sync(dq[dn], dsf, kf, dq[dn]);
      }
    }
  }
  store_fragments<T, D>(dq, p.scale, s_f32, p.dq, p.dqs, b, h, t_warp, p.steps, lane);
#endif
}

// dv = P^T dout and dk = scale dS^T Q over the query heads of the GQA group and their queries.
// One block per (64 key rows, kv head, batch).
template <class T, class L, int D>
__global__ void __launch_bounds__(warps * 32)
    mma_dkdv_kernel(attention_args<T, L> p, launch_extra x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  using sm = smem_layout<D>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  T* q_tile = reinterpret_cast<T*>(smem);
  T* do_tile = reinterpret_cast<T*>(smem + sm::rows_tile);
  unsigned char* per_warp = smem + 2 * sm::rows_tile;
  float* s_f32 = reinterpret_cast<float*>(per_warp + warp * sm::bwd_scratch);
  float* dp_f32 = s_f32 + frag * ld_f32;
  unsigned char* t_tiles = per_warp + warps * sm::bwd_scratch;
  T* p_tile = reinterpret_cast<T*>(t_tiles + (2 * warp) * sm::t_tile);
  T* ds_tile = reinterpret_cast<T*>(t_tiles + (2 * warp + 1) * sm::t_tile);
  float* lse_tile = reinterpret_cast<float*>(t_tiles + 2 * warps * sm::t_tile);
  float* delta_tile = lse_tile + tile;
  const std::int64_t b = blockIdx.z, hk = blockIdx.y, group = p.heads / p.kv_heads;
  const std::int64_t s_block = std::int64_t{blockIdx.x} * block_rows;
  const std::int64_t s_warp = s_block + warp * warp_rows;

  frag_a<T> kf[D / frag], vf[D / frag];
  load_row_fragments<T, D>(kf, s_f32, p.k, p.ks, b, hk, s_warp, p.keys, x.vec, lane);
  load_row_fragments<T, D>(vf, s_f32, p.v, p.vs, b, hk, s_warp, p.keys, x.vec, lane);
  frag_acc dk[D / frag], dv[D / frag];
#pragma unroll
  for (int dn = 0; dn < D / frag; ++dn) {
    wmma::fill_fragment(dk[dn], 0.0f);
    wmma::fill_fragment(dv[dn], 0.0f);
  }

  const int row = lane >> 1, half = lane & 1;
  const std::int64_t s = s_warp + row;
  // Queries before t_begin see none of this block's keys.
  const std::int64_t t_begin = p.causal ? max(std::int64_t{0}, s_block - (p.keys - p.steps)) : 0;
  for (std::int64_t g = 0; g < group; ++g) {
    const std::int64_t h = hk * group + g;
    for (std::int64_t t0 = t_begin; t0 < p.steps; t0 += tile) {
      __syncthreads();  // every warp is done with the previous tiles
      load_rows<T, D>(q_tile, sm::ld_rows, p.q, p.qs, b, h, t0, p.steps, tile, x.vec, threadIdx.x,
                      blockDim.x);
      load_rows<T, D>(do_tile, sm::ld_rows, p.dout, p.dos, b, h, t0, p.steps, tile, x.vec,
                      threadIdx.x, blockDim.x);
      for (int i = threadIdx.x; i < tile; i += blockDim.x) {
        const std::int64_t tq = t0 + i;
        const bool in = tq < p.steps;
        const std::int64_t at = (b * p.heads + h) * p.steps + tq;
        lse_tile[i] = in ? to_f32(p.lse[at]) : 0.0f;
        delta_tile[i] = in ? x.delta[at] : 0.0f;
      }
      __syncthreads();

      // S^T = K Q^T and dP^T = V dout^T ([16 keys][64 queries] f32 each).
#pragma unroll
      for (int n = 0; n < tile / frag; ++n) {
        frag_acc s_acc, dp_acc;
        wmma::fill_fragment(s_acc, 0.0f);
        wmma::fill_fragment(dp_acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < D / frag; ++kk) {
          frag_b<T, wmma::col_major> qf, dof;
          wmma::load_matrix_sync(qf, q_tile + n * frag * sm::ld_rows + kk * frag, sm::ld_rows);
          wmma::load_matrix_sync(dof, do_tile + n * frag * sm::ld_rows + kk * frag, sm::ld_rows);
          wmma::mma_sync(s_acc, kf[kk], qf, s_acc);
          wmma::mma_sync(dp_acc, vf[kk], dof, dp_acc);
        }
        wmma::store_matrix_sync(s_f32 + n * frag, s_acc, ld_f32, wmma::mem_row_major);
        wmma::store_matrix_sync(dp_f32 + n * frag, dp_acc, ld_f32, wmma::mem_row_major);
      }
      __syncwarp();

      // P^T and dS^T in f32, each rounded once to T.
      const int c0 = half * (tile / 2);
      for (int j = 0; j < tile / 2; ++j) {
        const int c = c0 + j;
        float pr = 0, ds = 0;
        if (p.visible(t0 + c, s)) {
          pr = expf(s_f32[row * ld_f32 + c] * p.scale - lse_tile[c]);
          ds = pr * (dp_f32[row * ld_f32 + c] - delta_tile[c]);
        }
        p_tile[row * ld_tile + c] = from_f32<T>(pr);
        ds_tile[row * ld_tile + c] = from_f32<T>(ds);
      }
      __syncwarp();

      // dv += P^T dout, dk += dS^T Q: [16][64] times the [64][D] tiles row-major.
#pragma unroll
      for (int dn = 0; dn < D / frag; ++dn) {
#pragma unroll
        for (int kk = 0; kk < tile / frag; ++kk) {
          frag_a<T> pf, dsf;
          frag_b<T, wmma::row_major> dof, qf;
          wmma::load_matrix_sync(pf, p_tile + kk * frag, ld_tile);
          wmma::load_matrix_sync(dof, do_tile + kk * frag * sm::ld_rows + dn * frag, sm::ld_rows);
          wmma::mma_sync(dv[dn], pf, dof, dv[dn]);
          wmma::load_matrix_sync(dsf, ds_tile + kk * frag, ld_tile);
          wmma::load_matrix_sync(qf, q_tile + kk * frag * sm::ld_rows + dn * frag, sm::ld_rows);
          wmma::mma_sync(dk[dn], dsf, qf, dk[dn]);
        }
      }
    }
  }
  store_fragments<T, D>(dk, p.scale, s_f32, p.dk, p.dks, b, hk, s_warp, p.keys, lane);
  store_fragments<T, D>(dv, 1.0f, s_f32, p.dv, p.dvs, b, hk, s_warp, p.keys, lane);
#endif
}

int compute_major() {
  int dev = 0, major = 0;
  TROUPE_CUDA_CHECK(cudaGetDevice(&dev));
  TROUPE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  return major;
}

bool aligned16(const void* p, const bthd& s) {
  return reinterpret_cast<std::uintptr_t>(p) % 16 == 0 && s.b % 8 == 0 && s.t % 8 == 0 &&
         s.h % 8 == 0;
}

unsigned blocks(std::int64_t rows) {
  return static_cast<unsigned>((rows + block_rows - 1) / block_rows);
}

// Launches kernel with `bytes` of dynamic shared memory (more than the default 48 KiB).
template <class... A>
void launch(void (*kernel)(A...), dim3 grid, std::size_t bytes, A... args) {
  TROUPE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(bytes)));
  kernel<<<grid, warps * 32, bytes>>>(args...);
  TROUPE_CUDA_CHECK_LAUNCH();
}

// Calls f(type_tag<T>, type_tag<L>) for 16-bit q.
template <class F>
void dispatch_16(const char* op, const tensor& q, const tensor& lse, F&& f) {
  auto with_lse = [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::dispatch_stat<T>(op, "lse", lse, [&](auto lse_tag) { f(tag, lse_tag); });
  };
  if (q.type() == dtype::bf16) return with_lse(detail::type_tag<__nv_bfloat16>{});
  if (q.type() == dtype::f16) return with_lse(detail::type_tag<__half>{});
  TROUPE_FAIL("cuda ", op, ": the tensor-core kernel takes bf16 or f16, got ",
              dtype_name(q.type()));
}

template <class T, class L, int D>
void forward(attention_args<T, L> p, launch_extra x) {
  dim3 grid(blocks(p.steps), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
  launch(mma_forward_kernel<T, L, D>, grid, smem_layout<D>::forward, p, x);
}

template <class T, class L, int D>
void backward(attention_args<T, L> p, launch_extra x) {
  if (p.steps > 0) {
    dim3 grid(blocks(p.steps), static_cast<unsigned>(p.heads), static_cast<unsigned>(p.batch));
    launch(mma_dq_kernel<T, L, D>, grid, smem_layout<D>::dq, p, x);
  }
  if (p.keys > 0) {  // keys no query sees (T = 0) get zero gradients
    dim3 grid(blocks(p.keys), static_cast<unsigned>(p.kv_heads), static_cast<unsigned>(p.batch));
    launch(mma_dkdv_kernel<T, L, D>, grid, smem_layout<D>::dkdv, p, x);
  }
}

}  // namespace

namespace detail {

bool attention_mma_applies(const tensor& q, const ops::attention_options& opt) {
  return (q.type() == dtype::bf16 || q.type() == dtype::f16) &&
         (q.size(3) == 64 || q.size(3) == 128) &&
         opt.kernel == ops::attention_kernel::tensor_cores && !opt.segments.defined() &&
         compute_major() >= 8;
}

void attention_mma(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                   const tensor& lse, const ops::attention_options& opt) {
  dispatch_16("attention", q, lse, [&](auto tag, auto lse_tag) {
    using T = typename decltype(tag)::type;
    using L = typename decltype(lse_tag)::type;
    auto p = make_attention_args<T, L>("attention", 128, q, k, v, out, lse, opt);
    if (p.batch == 0 || p.steps == 0 || p.heads == 0) return;
    p.out_w = ptr<T>(out);
    launch_extra x;
    x.vec = aligned16(p.q, p.qs) && aligned16(p.k, p.ks) && aligned16(p.v, p.vs);
    if (p.dim == 64)
      forward<T, L, 64>(p, x);
    else
      forward<T, L, 128>(p, x);
  });
}

void attention_mma_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                            const tensor& dout, const tensor& lse, const tensor& dq,
                            const tensor& dk, const tensor& dv, const ops::attention_options& opt) {
  dispatch_16("attention_backward", q, lse, [&](auto tag, auto lse_tag) {
    using T = typename decltype(tag)::type;
    using L = typename decltype(lse_tag)::type;
    auto p = make_attention_args<T, L>("attention_backward", 128, q, k, v, out, lse, opt);
    if (p.batch == 0 || p.heads == 0) return;
    add_backward_args(p, dout, dq, dk, dv);
    launch_extra x;
    x.vec = aligned16(p.q, p.qs) && aligned16(p.k, p.ks) && aligned16(p.v, p.vs) &&
            aligned16(p.dout, p.dos);
    const std::int64_t rows = p.batch * p.heads * p.steps;
    f32_scratch_lease delta = lease_f32_scratch(std::max<std::int64_t>(rows, 1));
    x.delta = delta.p;
    if (rows > 0) {
      mma_delta_kernel<T, L><<<grid_for(rows * 32), 256>>>(p, delta.p);
      TROUPE_CUDA_CHECK_LAUNCH();
    }
    if (p.dim == 64)
      backward<T, L, 64>(p, x);
    else
      backward<T, L, 128>(p, x);
  });
}

}  // namespace detail

const char* attention_kernel_for(const tensor& q, const ops::attention_options& opt) {
  return detail::attention_mma_applies(q, opt) ? "cuda tensor cores" : "cuda cores";
}

}  // namespace troupe::cuda
