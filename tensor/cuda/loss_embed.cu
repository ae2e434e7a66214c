// CUDA embedding lookup (+ backward with atomicAdd) and the fused softmax cross-entropy, f32
// (the lookup also copies bf16/f16 tables). Ids and targets are checked on the device; both ops
// wait for the device to read the check (and cross_entropy's count) back, and a bad id or target
// is a troupe::error naming the first offender the device saw.
#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::block_max;
using detail::block_sum;
using detail::ptr;

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

// One block per row (blocks stride over rows). dlogits may be null or alias logits: thread 0 reads
// the target's logit before the block reductions, whose barriers order it before any write.
template <class Id>
__global__ void cross_entropy_kernel(const float* logits, const Id* targets, float* losses,
                                     float* dlogits, std::int64_t rows, std::int64_t cols,
                                     float grad_scale, std::int64_t ignore_index,
                                     long long* words) {
  __shared__ float shared[32];
  for (std::int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    const float* xr = logits + r * cols;
    float* dr = dlogits != nullptr ? dlogits + r * cols : nullptr;
    const std::int64_t t = static_cast<std::int64_t>(targets[r]);  // the same in every thread
    if (t == ignore_index || t < 0 || t >= cols) {
      if (t != ignore_index && threadIdx.x == 0) report_bad(words, r, t);
      if (threadIdx.x == 0) losses[r] = t == ignore_index ? 0.0f : NAN;
      if (dr != nullptr)
        for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) dr[c] = 0.0f;
      continue;
    }
    float xt = threadIdx.x == 0 ? xr[t] : 0.0f;
    float m = -INFINITY;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, xr[c]);
    m = block_max(m, shared);
    float s = 0;
    for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x) s += expf(xr[c] - m);
    const float lse = m + logf(block_sum(s, shared));
    if (threadIdx.x == 0) {
      losses[r] = lse - xt;
      atomicAdd(reinterpret_cast<unsigned long long*>(words + 3), 1ull);
    }
    if (dr != nullptr)
      for (std::int64_t c = threadIdx.x; c < cols; c += blockDim.x)
        dr[c] = (expf(xr[c] - lse) - (c == t ? 1.0f : 0.0f)) * grad_scale;
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
  detail::need_f32("embedding_backward", dtable);
  std::int64_t n = ids.numel(), cols = dtable.size(1), vocab = dtable.size(0);
  if (n * cols == 0) return;
  check_words w{};
  dispatch_ids(ids, [&](auto id_tag) {
    using Id = typename decltype(id_tag)::type;
    auto lease = detail::lease_scratch();
    TROUPE_CUDA_CHECK(cudaMemsetAsync(lease.s->words, 0, sizeof(check_words)));
    embedding_backward_kernel<Id><<<detail::grid_for(n * cols), detail::block_threads>>>(
        ptr<Id>(ids), ptr<float>(dout), ptr<float>(dtable), n, cols, vocab, lease.s->words);
    TROUPE_CUDA_CHECK_LAUNCH();
    w = read_words(lease);
  });
  TROUPE_CHECK(w.bad == 0, "cuda embedding_backward: id ", w.value, " at position ", w.position,
               " is out of range for a table of ", vocab, " rows");
}

std::int64_t cross_entropy(const tensor& logits, const tensor& targets, const tensor& losses,
                           const tensor& dlogits, double grad_scale, std::int64_t ignore_index) {
  detail::need_f32("cross_entropy", logits);
  std::int64_t cols = logits.dim() == 0 ? 1 : logits.size(-1);
  std::int64_t rows = cols == 0 ? 0 : logits.numel() / cols;
  if (rows == 0) return 0;
  check_words w{};
  dispatch_ids(targets, [&](auto id_tag) {
    using Id = typename decltype(id_tag)::type;
    auto lease = detail::lease_scratch();
    TROUPE_CUDA_CHECK(cudaMemsetAsync(lease.s->words, 0, sizeof(check_words)));
    unsigned blocks = static_cast<unsigned>(std::min(rows, max_row_blocks));
    cross_entropy_kernel<Id><<<blocks, detail::block_threads>>>(
        ptr<float>(logits), ptr<Id>(targets), ptr<float>(losses),
        dlogits.defined() ? ptr<float>(dlogits) : nullptr, rows, cols,
        static_cast<float>(grad_scale), ignore_index, lease.s->words);
    TROUPE_CUDA_CHECK_LAUNCH();
    w = read_words(lease);
  });
  TROUPE_CHECK(w.bad == 0, "cuda cross_entropy: target ", w.value, " of row ", w.position,
               " is out of range for ", cols, " classes");
  return w.count;
}

}  // namespace troupe::cuda
