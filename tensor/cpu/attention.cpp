// CPU backend: flash attention (forward and FlashAttention-2 backward) in 64 x 64 tiles.
//
// Forward: for each block of 64 queries of one head, walk the key blocks with an online softmax
// (running max and sum per query, output rescaled as the max grows) and save lse = log-sum-exp of
// each query's scores. Backward: for each key/value head, and each query block of each query head
// of its group, walk the visible key blocks: recompute P = exp(S - lse) from the saved lse, then
// dP = dO V^T, dS = P * (dP - rowsum(dO * O)), and accumulate dV += P^T dO and dK += dS^T Q in
// place and dQ += dS K in a tile. A thread owns whole key/value heads in backward, so no two
// threads write the same dq, dk or dv rows. Neither pass ever holds a T x S matrix: per-thread
// scratch is a few tiles.
//
// The tile kernels (attention_tiles.inc) are compiled for AVX2 and for AVX-512; the CPU decides.
// bf16 and f16 tensors are widened to f32 as their rows are copied into the tiles (which are f32),
// results are rounded once as they are stored, and lse may be f32 (ops.cpp). Their backward keeps
// dk and dv of the head in hand in f32 rows (2 S D floats more scratch) and rounds them at the end.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>

#include "memory/buffer.hpp"
#include "memory/error.hpp"
#include "tensor/backend.hpp"
#include "tensor/cpu/attention.hpp"
#include "tensor/cpu/blas_info.hpp"
#include "tensor/cpu/half.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {
namespace {

constexpr std::int64_t block_q = 64;  // queries per tile (a multiple of every vector width)
constexpr std::int64_t block_k = 64;  // keys per tile
constexpr double log2e = 1.4426950408889634;
constexpr double ln2 = 0.6931471805599453;

// A [B, T, H, D] view with a unit last stride.
template <class T>
struct bthd {
  T* p = nullptr;
  std::int64_t sb = 0, st = 0, sh = 0;
  T* at(std::int64_t b, std::int64_t t, std::int64_t h) const {
    return p + b * sb + t * st + h * sh;
  }
};

template <class T>
bthd<T> view_of(const tensor& x) {
  if (!x.defined()) return {};
  return {static_cast<T*>(x.data()), x.stride(0), x.stride(1), x.stride(2)};
}

// S: the storage type of q, k, v, out and the gradients; L: that of lse.
template <class S, class L>
struct attn_args {
  bthd<S> q, k, v, out, dout, dq, dk, dv;
  L* lse = nullptr;
  std::int64_t b = 0, t = 0, s = 0, hq = 0, hkv = 0, group = 0, d = 0, d_padded = 0;
  std::int64_t off = 0;  // S - T: query t sees keys s <= t + off when causal
  double scale = 0;
  bool causal = true;
  const std::int32_t* seg = nullptr;  // packed rows: segment ids [B, T] (T == S), or none
};

std::int64_t padded_dim(std::int64_t d, std::size_t elem) {
  const std::int64_t w = 64 / static_cast<std::int64_t>(elem);
  return (d + w - 1) / w * w;
}

// Elements of scratch per thread; the layouts are spelled out in attention_tiles.inc.
std::int64_t scratch_elems(std::int64_t d, std::size_t elem) {
  const std::int64_t dp = padded_dim(d, elem);
  const std::int64_t fwd =
      d * block_q + block_k * block_q + (block_q + 2 * block_k) * dp + 3 * block_q;
  const std::int64_t bwd =
      2 * d * block_q + 2 * block_k * block_q + (3 * block_q + 2 * block_k) * dp + 2 * block_q;
  return std::max(fwd, bwd);
}

std::atomic<std::int64_t> held_bytes{0};

// One thread's scratch: grown on demand, kept for the life of the thread.
class scratch_slot {
 public:
  scratch_slot() = default;
  scratch_slot(const scratch_slot&) = delete;
  scratch_slot& operator=(const scratch_slot&) = delete;
  ~scratch_slot() { held_bytes -= static_cast<std::int64_t>(buf_.size()); }
  void* get(std::size_t bytes) {
    if (buf_.size() < bytes) {
      held_bytes -= static_cast<std::int64_t>(buf_.size());
      buf_ = memory::buffer();
      buf_ = memory::buffer::host(bytes);
      held_bytes += static_cast<std::int64_t>(bytes);
    }
    return buf_.data();
  }

 private:
  memory::buffer buf_;
};

thread_local scratch_slot t_scratch;

// Elements (of the compute type, elem bytes each) one thread needs; backward of 16-bit tensors
// adds f32 rows for dk and dv of a head of s keys.
std::int64_t scratch_elems(std::int64_t d, std::size_t elem, bool half_backward, std::int64_t s) {
  return scratch_elems(d, elem) + (half_backward ? 2 * s * padded_dim(d, elem) : 0);
}

template <class S, class L>
compute_t<S>* thread_scratch(const attn_args<S, L>& g, bool backward) {
  using T = compute_t<S>;
  const std::int64_t n = scratch_elems(g.d, sizeof(T), backward && is_half<S>, g.s);
  return static_cast<T*>(t_scratch.get(static_cast<std::size_t>(n) * sizeof(T)));
}

namespace avx2 {
#define TROUPE_ATTN_VBYTES 32
#include "tensor/cpu/attention_tiles.inc"
#undef TROUPE_ATTN_VBYTES
}  // namespace avx2

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq")
namespace avx512 {
#define TROUPE_ATTN_VBYTES 64
#include "tensor/cpu/attention_tiles.inc"
#undef TROUPE_ATTN_VBYTES
}  // namespace avx512
#pragma GCC pop_options

bool use_avx512() {
  static const bool yes = cpu_has_avx512();
  return yes;
}

template <class S, class L>
attn_args<S, L> make_args(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                          const tensor& lse, const ops::attention_options& opt) {
  attn_args<S, L> g;
  g.q = view_of<S>(q);
  g.k = view_of<S>(k);
  g.v = view_of<S>(v);
  g.out = view_of<S>(out);
  g.lse = static_cast<L*>(lse.data());
  g.b = q.size(0);
  g.t = q.size(1);
  g.hq = q.size(2);
  g.d = q.size(3);
  g.s = k.size(1);
  g.hkv = k.size(2);
  g.group = g.hq / g.hkv;
  g.d_padded = padded_dim(g.d, sizeof(compute_t<S>));
  g.off = g.s - g.t;
  g.scale = opt.scale != 0.0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(g.d));
  g.causal = opt.causal;
  if (opt.segments.defined()) g.seg = opt.segments.data_as<std::int32_t>();
  return g;
}

// Calls f(S{}, L{}) for the storage types of q and of lse (L is S, or f32 for 16-bit S).
template <class F>
void dispatch_attention(const char* op, const tensor& q, const tensor& lse, F&& f) {
  dispatch_floating(op, q.type(), [&]<class S>(S) {
    if constexpr (is_half<S>) {
      if (lse.type() == dtype::f32) return f(S{}, float{});
    }
    f(S{}, S{});
  });
}

}  // namespace

std::size_t attention_scratch_bytes() {
  return static_cast<std::size_t>(held_bytes.load());
}

std::size_t attention_scratch_bytes_per_thread(std::int64_t d, dtype t, std::int64_t s) {
  const bool half = t == dtype::bf16 || t == dtype::f16;
  const std::size_t elem = half ? sizeof(float) : dtype_size(t);
  return static_cast<std::size_t>(scratch_elems(d, elem, half, s)) * elem;
}

void attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
               const tensor& lse, const ops::attention_options& opt) {
  if (lse.numel() == 0) return;
  dispatch_attention("attention", q, lse, [&]<class S, class L>(S, L) {
    const attn_args<S, L> g = make_args<S, L>(q, k, v, out, lse, opt);
    use_avx512() ? avx512::forward(g) : avx2::forward(g);
  });
}

void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& dout, const tensor& lse, const tensor& dq, const tensor& dk,
                        const tensor& dv, const ops::attention_options& opt) {
  if (k.numel() == 0) return;
  dispatch_attention("attention_backward", q, lse, [&]<class S, class L>(S, L) {
    attn_args<S, L> g = make_args<S, L>(q, k, v, out, lse, opt);
    g.dout = view_of<S>(dout);
    g.dq = view_of<S>(dq);
    g.dk = view_of<S>(dk);
    g.dv = view_of<S>(dv);
    use_avx512() ? avx512::backward(g) : avx2::backward(g);
  });
}

}  // namespace troupe::cpu
