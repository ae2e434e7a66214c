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

template <class T>
struct attn_args {
  bthd<T> q, k, v, out, dout, dq, dk, dv;
  T* lse = nullptr;
  std::int64_t b = 0, t = 0, s = 0, hq = 0, hkv = 0, group = 0, d = 0, d_padded = 0;
  std::int64_t off = 0;  // S - T: query t sees keys s <= t + off when causal
  double scale = 0;
  bool causal = true;
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

template <class T>
T* thread_scratch(const attn_args<T>& g) {
  return static_cast<T*>(t_scratch.get(scratch_elems(g.d, sizeof(T)) * sizeof(T)));
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

template <class T>
attn_args<T> make_args(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                       const tensor& lse, const ops::attention_options& opt) {
  attn_args<T> g;
  g.q = view_of<T>(q);
  g.k = view_of<T>(k);
  g.v = view_of<T>(v);
  g.out = view_of<T>(out);
  g.lse = static_cast<T*>(lse.data());
  g.b = q.size(0);
  g.t = q.size(1);
  g.hq = q.size(2);
  g.d = q.size(3);
  g.s = k.size(1);
  g.hkv = k.size(2);
  g.group = g.hq / g.hkv;
  g.d_padded = padded_dim(g.d, sizeof(T));
  g.off = g.s - g.t;
  g.scale = opt.scale != 0.0 ? opt.scale : 1.0 / std::sqrt(static_cast<double>(g.d));
  g.causal = opt.causal;
  return g;
}

void check_dtype(const char* op, dtype t) {
  TROUPE_CHECK(t == dtype::f32 || t == dtype::f64, "cpu ", op, ": dtype ", dtype_name(t),
               " not supported (f32 and f64 are)");
}

}  // namespace

std::size_t attention_scratch_bytes() {
  return static_cast<std::size_t>(held_bytes.load());
}

std::size_t attention_scratch_bytes_per_thread(std::int64_t d, dtype t) {
  return static_cast<std::size_t>(scratch_elems(d, dtype_size(t))) * dtype_size(t);
}

void attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
               const tensor& lse, const ops::attention_options& opt) {
  check_dtype("attention", q.type());
  if (lse.numel() == 0) return;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const attn_args<T> g = make_args<T>(q, k, v, out, lse, opt);
    use_avx512() ? avx512::forward(g) : avx2::forward(g);
  };
  q.type() == dtype::f32 ? run(float{}) : run(double{});
}

void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& dout, const tensor& lse, const tensor& dq, const tensor& dk,
                        const tensor& dv, const ops::attention_options& opt) {
  check_dtype("attention_backward", q.type());
  if (k.numel() == 0) return;
  auto run = [&](auto zero) {
    using T = decltype(zero);
    attn_args<T> g = make_args<T>(q, k, v, out, lse, opt);
    g.dout = view_of<T>(dout);
    g.dq = view_of<T>(dq);
    g.dk = view_of<T>(dk);
    g.dv = view_of<T>(dv);
    use_avx512() ? avx512::backward(g) : avx2::backward(g);
  };
  q.type() == dtype::f32 ? run(float{}) : run(double{});
}

}  // namespace troupe::cpu
