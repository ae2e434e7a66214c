// CUDA embedding lookup and backward, and the fused softmax cross-entropy, for f32, bf16 and f16.
// Ids and targets are checked on the device; the ops wait for the device to read the check (and
// cross_entropy's count) back, and a bad id or target is a troupe::error naming the first
// offender the device saw.
//
// embedding_backward: f32 tables take atomicAdd per element. 16-bit tables cannot (a rounding per
// added row would lose every small gradient against a large one), so each table row has one owner
// block, the first position holding its id, which adds the dout rows of all positions with that id
// in position order in f32 and rounds once onto the table: dtable = round(dtable + sum). No
// scratch, and the same result on every run.
//
// cross_entropy computes in f32 from the loaded logits; losses are stored in the logits' dtype or
// in f32, dlogits in the logits' dtype.
#include <type_traits>

#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::block_max;
using detail::block_sum;
using detail::from_f32;
using detail::ptr;
using detail::to_f32;

// words[0]: a bad index was seen; words[1]: its position; words[2]: its value; words[3]: count.
__device__ void report_bad(long long* words, std::int64_t position, std::int64_t value) {
  if (atomicCAS(reinterpret_cast<unsigned long long*>(words), 0ull, 1ull) == 0ull) {
    words[1] = position;
    words[2] = value;
  }
}

template <class T, class Id>
__global__ void embedding_kernel(const Id* ids, const T* table, T* out, std::int64_t n,
                                 std::int64_t cols, std::int64_t vocab, long long* words) {
  TROUPE_GRID_STRIDE(k, n * cols) {
    std::int64_t r = k / cols, c = k % cols;
    std::int64_t id = static_cast<std::int64_t>(ids[r]);
    if (id < 0 || id >= vocab) {
      if (c == 0) report_bad(words, r, id);
      continue;
    }
    out[k] = table[id * cols + c];
  }
}

template <class Id>
__global__ void embedding_backward_kernel(const Id* ids, const float* dout, float* dtable,
                                          std::int64_t n, std::int64_t cols, std::int64_t vocab,
                                          long long* words) {
  TROUPE_GRID_STRIDE(k, n * cols) {
    std::int64_t r = k / cols, c = k % cols;
    std::int64_t id = static_cast<std::int64_t>(ids[r]);
    if (id < 0 || id >= vocab) {
      if (c == 0) report_bad(words, r, id);
      continue;
    }
    atomicAdd(dtable + id * cols + c, dout[k]);
  }
}

// 16-bit embedding backward: block x is position p, block y a chunk of eb_chunk columns. The block
// scans the ids in steps of eb_threads positions (a ballot mask per warp); if an earlier position
// holds the same id the block leaves (that position owns the row), otherwise it adds the dout rows
// of the matching positions to its f32 accumulators and finally rounds them onto dtable.
constexpr int eb_threads = 256;
constexpr int eb_cols_per_thread = 4;
constexpr std::int64_t eb_chunk = eb_threads * eb_cols_per_thread;

template <class T, class Id>
__global__ void __launch_bounds__(eb_threads)
    embedding_backward_owner_kernel(const Id* ids, const T* dout, T* dtable, std::int64_t n,
                                    std::int64_t cols, std::int64_t vocab, long long* words) {
  __shared__ unsigned masks[eb_threads / 32];
  const std::int64_t p = blockIdx.x;
  const std::int64_t id = static_cast<std::int64_t>(ids[p]);
  if (id < 0 || id >= vocab) {
    if (threadIdx.x == 0 && blockIdx.y == 0) report_bad(words, p, id);
    return;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t c0 = blockIdx.y * eb_chunk + threadIdx.x;  // + eb_threads * i
  float acc[eb_cols_per_thread] = {};
  for (std::int64_t m0 = 0; m0 < n; m0 += eb_threads) {
    const std::int64_t m = m0 + threadIdx.x;
    const unsigned same =
        __ballot_sync(0xffffffffu, m < n && static_cast<std::int64_t>(ids[m]) == id);
    if (lane == 0) masks[warp] = same;
    __syncthreads();
    // Every thread reads the same masks, so `earlier` and the loops below are block-uniform.
    bool earlier = false;
    for (int w = 0; w < eb_threads / 32; ++w) {
      const std::int64_t first = m0 + 32 * w;  // position of bit 0 of masks[w]
      if (first >= p) break;
      const unsigned below = p - first >= 32 ? 0xffffffffu : (1u << (p - first)) - 1u;
      earlier = earlier || (masks[w] & below) != 0;
    }
    if (earlier) return;
    for (int w = 0; w < eb_threads / 32; ++w) {
      for (unsigned mask = masks[w]; mask != 0; mask &= mask - 1) {
        const std::int64_t row = m0 + 32 * w + (__ffs(static_cast<int>(mask)) - 1);
        const T* dr = dout + row * cols;
#pragma unroll
        for (int i = 0; i < eb_cols_per_thread; ++i) {
          const std::int64_t c = c0 + std::int64_t{eb_threads} * i;
          if (c < cols) acc[i] += to_f32(dr[c]);
        }
      }
    }
    __syncthreads();  // the masks are read before the next step writes them
  }
  T* tr = dtable + id * cols;
#pragma unroll
  for (int i = 0; i < eb_cols_per_thread; ++i) {
    const std::int64_t c = c0 + std::int64_t{eb_threads} * i;
    if (c < cols) detail::add_rounded(tr[c], acc[i]);
  }
}

// One block per row (blocks stride over rows). dlogits may be null or alias logits: thread 0 reads
// the target's logit before the block reductions, whose barriers order it before any write.
// T: logits and dlogits; L: losses (T or float).
template <class T, class L, class Id>
__global__ void cross_entropy_kernel(const T* logits, const Id* targets, L* losses, T* dlogits,
                                     std::int64_t rows, std::int64_t cols, float grad_scale,
                                     std::int64_t ignore_index, long long* words) {
  __shared__ float shared[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const T* xr = logits + r * cols;
    T* dr = dlogits != nullptr ? dlogits + r * cols : nullptr;
    const std::int64_t t = static_cast<std::int64_t>(targets[r]);  // the same in every thread
    if (t == ignore_index || t < 0 || t >= cols) {
      if (t != ignore_index && threadIdx.x == 0) report_bad(words, r, t);
      if (threadIdx.x == 0) losses[r] = from_f32<L>(t == ignore_index ? 0.0f : NAN);
      if (dr != nullptr)
        for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) dr[c] = from_f32<T>(0.0f);
      continue;
    }
    float xt = threadIdx.x == 0 ? to_f32(xr[t]) : 0.0f;
    float m = -INFINITY;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, to_f32(xr[c]));
    m = block_max(m, shared);
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(to_f32(xr[c]) - m);
    const float lse = m + logf(block_sum(s, shared));
    if (threadIdx.x == 0) {
      losses[r] = from_f32<L>(lse - xt);
      atomicAdd(reinterpret_cast<unsigned long long*>(words + 3), 1ull);
    }
    if (dr != nullptr)
      for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
        dr[c] = from_f32<T>((expf(to_f32(xr[c]) - lse) - (c == t ? 1.0f : 0.0f)) * grad_scale);
  }
}

// Calls f(type_tag<Id>{}) for i32 or i64 ids (ops.cpp allows no other).
template <class F>
void dispatch_ids(const tensor& ids, F&& f) {
  if (ids.type() == dtype::i32)
    f(detail::type_tag<std::int32_t>{});
  else
    f(detail::type_tag<std::int64_t>{});
}

struct check_words {
  long long bad, position, value, count;
};
check_words read_words(const detail::scratch_lease& lease) {
  check_words w{};
  TROUPE_CUDA_CHECK(cudaMemcpy(&w, lease.s->words, sizeof w, cudaMemcpyDeviceToHost));
  return w;
}

constexpr std::int64_t max_row_blocks = 1 << 20;
constexpr std::int64_t max_owner_positions = 0x7fffffff;  // gridDim.x

}  // namespace

void embedding(const tensor& ids, const tensor& table, const tensor& out) {
  std::int64_t n = ids.numel(), cols = table.size(1), vocab = table.size(0);
  if (n * cols == 0) return;
  check_words w{};
  detail::dispatch_16_32("embedding", table, [&](auto tag) {
    using T = typename decltype(tag)::type;
    dispatch_ids(ids, [&](auto id_tag) {
      using Id = typename decltype(id_tag)::type;
      auto lease = detail::lease_scratch();
      TROUPE_CUDA_CHECK(cudaMemsetAsync(lease.s->words, 0, sizeof(check_words)));
      embedding_kernel<T, Id><<<detail::grid_for(n * cols), detail::block_threads>>>(
          ptr<Id>(ids), ptr<T>(table), ptr<T>(out), n, cols, vocab, lease.s->words);
      TROUPE_CUDA_CHECK_LAUNCH();
      w = read_words(lease);
    });
  });
  TROUPE_CHECK(w.bad == 0, "cuda embedding: id ", w.value, " at position ", w.position,
               " is out of range for a table of ", vocab, " rows");
}

void embedding_backward(const tensor& ids, const tensor& dout, const tensor& dtable) {
  std::int64_t n = ids.numel(), cols = dtable.size(1), vocab = dtable.size(0);
  check_words w{};
  detail::dispatch_16_32("embedding_backward", dtable, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (n * cols == 0) return;
    dispatch_ids(ids, [&](auto id_tag) {
      using Id = typename decltype(id_tag)::type;
      auto lease = detail::lease_scratch();
      TROUPE_CUDA_CHECK(cudaMemsetAsync(lease.s->words, 0, sizeof(check_words)));
      if constexpr (std::is_same_v<T, float>) {
        embedding_backward_kernel<Id><<<detail::grid_for(n * cols), detail::block_threads>>>(
            ptr<Id>(ids), ptr<float>(dout), ptr<float>(dtable), n, cols, vocab, lease.s->words);
      } else {
        TROUPE_CHECK(n <= max_owner_positions, "cuda embedding_backward: ", n,
                     " positions exceed the grid limit ", max_owner_positions);
        dim3 grid(static_cast<unsigned>(n),
                  static_cast<unsigned>((cols + eb_chunk - 1) / eb_chunk));
        embedding_backward_owner_kernel<T, Id><<<grid, eb_threads>>>(
            ptr<Id>(ids), ptr<T>(dout), ptr<T>(dtable), n, cols, vocab, lease.s->words);
      }
      TROUPE_CUDA_CHECK_LAUNCH();
      w = read_words(lease);
    });
  });
  TROUPE_CHECK(w.bad == 0, "cuda embedding_backward: id ", w.value, " at position ", w.position,
               " is out of range for a table of ", vocab, " rows");
}

std::int64_t cross_entropy(const tensor& logits, const tensor& targets, const tensor& losses,
                           const tensor& dlogits, double grad_scale, std::int64_t ignore_index) {
  std::int64_t cols = logits.dim() == 0 ? 1 : logits.size(-1);
  std::int64_t rows = cols == 0 ? 0 : logits.numel() / cols;
  check_words w{};
  detail::dispatch_16_32("cross_entropy", logits, [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::dispatch_stat<T>("cross_entropy", "losses", losses, [&](auto loss_tag) {
      using L = typename decltype(loss_tag)::type;
      if (rows == 0) return;
      dispatch_ids(targets, [&](auto id_tag) {
        using Id = typename decltype(id_tag)::type;
        auto lease = detail::lease_scratch();
        TROUPE_CUDA_CHECK(cudaMemsetAsync(lease.s->words, 0, sizeof(check_words)));
        unsigned blocks = static_cast<unsigned>(std::min(rows, max_row_blocks));
        cross_entropy_kernel<T, L, Id><<<blocks, detail::block_threads>>>(
            ptr<T>(logits), ptr<Id>(targets), ptr<L>(losses),
            dlogits.defined() ? ptr<T>(dlogits) : nullptr, rows, cols,
            static_cast<float>(grad_scale), ignore_index, lease.s->words);
        TROUPE_CUDA_CHECK_LAUNCH();
        w = read_words(lease);
      });
    });
  });
  TROUPE_CHECK(w.bad == 0, "cuda cross_entropy: target ", w.value, " of row ", w.position,
               " is out of range for ", cols, " classes");
  return w.count;
}

}  // namespace troupe::cuda
