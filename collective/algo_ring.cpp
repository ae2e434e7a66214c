// Ring reduce-scatter and all-gather, pipelined in chunks, and the ring allreduce built from them.
//
// Rank me sends to me+1 and receives from me-1. Reduce-scatter step s sends block me-s-1 and
// receives block me-s-2; after n-1 steps rank me holds block me fully reduced. All-gather step s
// sends block me-s and receives block me-s-1. Each block is cut into K chunks (K from
// algo_tuning::chunk_bytes, the same for every block), and messages run in (step, chunk) order on
// both sides, which is what the transport's per-pair FIFO matching needs. The next `window`
// receives are always posted before a received chunk is reduced, so the transfer of chunk k+1
// overlaps the reduction of chunk k, and a reduced chunk is sent on at once.
#include <algorithm>
#include <cstring>

#include "collective/algo.hpp"
#include "collective/reduce.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

namespace {

struct layout {
  std::vector<std::size_t> off, len;  // elements
  std::size_t max_len = 0;
};

layout even_split(std::size_t count, int n) {
  layout L;
  L.off.resize(n);
  L.len.resize(n);
  for (int b = 0; b < n; ++b) {
    L.off[b] = count * b / n;
    L.len[b] = count * (b + 1) / n - L.off[b];
    L.max_len = std::max(L.max_len, L.len[b]);
  }
  return L;
}

layout uniform_blocks(std::size_t count, int n) {
  layout L;
  L.off.resize(n);
  L.len.assign(n, count);
  for (int b = 0; b < n; ++b) L.off[b] = count * b;
  L.max_len = count;
  return L;
}

inline int mod(int a, int n) {
  return ((a % n) + n) % n;
}

std::size_t chunks_for(const layout& L, std::size_t wire_esize, const algo_tuning& tune) {
  std::size_t bytes = L.max_len * wire_esize;
  std::size_t k = (bytes + tune.chunk_bytes - 1) / std::max<std::size_t>(tune.chunk_bytes, 1);
  return std::max<std::size_t>(k, 1);
}

// Elements [lo, hi) of chunk k of block b (absolute offsets).
inline std::pair<std::size_t, std::size_t> chunk_of(const layout& L, int b, std::size_t k,
                                                    std::size_t K) {
  return {L.off[b] + L.len[b] * k / K, L.off[b] + L.len[b] * (k + 1) / K};
}

inline char* at(void* p, std::size_t elems, std::size_t esize) {
  return static_cast<char*>(p) + elems * esize;
}
inline const char* at(const void* p, std::size_t elems, std::size_t esize) {
  return static_cast<const char*>(p) + elems * esize;
}

// Reduce-scatter of `src` (blocks by L, type t). Partial sums go to `acc` (laid out like src, in t
// for f32/f64, in f32 for 16-bit; acc may equal src for an in-place f32/f64 allreduce); block me
// ends in `out` (len[me] elements of t), divided by `divisor` (avg).
void ring_reduce_scatter(op_context& c, const void* src, void* acc, void* out, const layout& L,
                         dtype t, reduce_op op, double divisor) {
  const int n = c.n, me = c.me;
  const bool same = t == dtype::f32 || t == dtype::f64;
  const std::size_t tsz = dtype_size(t), asz = same ? tsz : 4;
  if (n == 1) {
    const std::size_t len = L.len[0];
    if (out != src) std::memmove(out, at(src, L.off[0], tsz), len * tsz);
    if (divisor != 1.0) {
      if (same) {
        divide(out, len, t, divisor);
      } else {
        float* f = static_cast<float*>(c.scratch->get(2, len * 4));
        widen(f, static_cast<const std::uint16_t*>(out), len, t);
        narrow(static_cast<std::uint16_t*>(out), f, len, t, static_cast<float>(divisor));
      }
    }
    return;
  }
  const int right = mod(me + 1, n), left = mod(me - 1, n);
  const std::size_t K = chunks_for(L, asz, c.tune);
  const std::size_t M = static_cast<std::size_t>(n - 1) * K;
  const std::size_t W = static_cast<std::size_t>(std::max(c.tune.window, 1));
  const std::size_t slot_elems = (L.max_len + K - 1) / K + 1;
  char* slots = static_cast<char*>(c.scratch->get(1, W * slot_elems * asz));
  auto slot = [&](std::size_t i) { return slots + (i % W) * slot_elems * asz; };
  auto recv_block = [&](std::size_t s) { return mod(me - static_cast<int>(s) - 2, n); };
  auto send_block = [&](std::size_t s) { return mod(me - static_cast<int>(s) - 1, n); };

  std::vector<p2p_request> recvs(W), sends;
  sends.reserve(M);
  auto post_recv = [&](std::size_t i) {
    if (i >= M) return;
    auto [lo, hi] = chunk_of(L, recv_block(i / K), i % K, K);
    recvs[i % W] = hi > lo ? c.irecv(left, slot(i), (hi - lo) * asz) : p2p_request{};
  };
  auto post_send = [&](std::size_t i) {
    const std::size_t s = i / K;
    auto [lo, hi] = chunk_of(L, send_block(s), i % K, K);
    if (hi == lo) return;
    const void* p =
        (s == 0 && same) ? at(src, lo, tsz) : at(static_cast<const void*>(acc), lo, asz);
    sends.push_back(c.isend(right, p, (hi - lo) * asz));
  };

  for (std::size_t i = 0; i < std::min(W, M); ++i) post_recv(i);
  if (!same) {  // step 0 sends the own block widened to f32
    const int b = send_block(0);
    widen(reinterpret_cast<float*>(at(acc, L.off[b], 4)),
          reinterpret_cast<const std::uint16_t*>(at(src, L.off[b], tsz)), L.len[b], t);
  }
  for (std::size_t k = 0; k < K; ++k) post_send(k);

  for (std::size_t i = 0; i < M; ++i) {
    const std::size_t s = i / K;
    auto [lo, hi] = chunk_of(L, recv_block(s), i % K, K);
    if (hi > lo) {
      c.wait(recvs[i % W]);
      const std::size_t len = hi - lo;
      const void* own = at(src, lo, tsz);
      if (s + 2 < static_cast<std::size_t>(n)) {  // a partial sum, passed on at the next step
        if (same)
          reduce_same(at(acc, lo, asz), slot(i), own, len, t, op);
        else
          reduce_widen(reinterpret_cast<float*>(at(acc, lo, 4)),
                       reinterpret_cast<const float*>(slot(i)),
                       static_cast<const std::uint16_t*>(own), len, t, op);
      } else {  // the last step: block me is complete
        void* dst = at(out, lo - L.off[me], tsz);
        if (same) {
          reduce_same(dst, slot(i), own, len, t, op);
          if (divisor != 1.0) divide(dst, len, t, divisor);
        } else {
          reduce_narrow(static_cast<std::uint16_t*>(dst), reinterpret_cast<const float*>(slot(i)),
                        static_cast<const std::uint16_t*>(own), len, t, op,
                        static_cast<float>(divisor));
        }
      }
    }
    post_recv(i + W);
    if (s + 2 < static_cast<std::size_t>(n)) post_send(i + K);
  }
  c.wait_all(sends);
}

// All-gather in place over `buf` (blocks by L, element size esize). Block me is taken from
// `own` when given (and copied into buf), else it is already in buf.
void ring_all_gather(op_context& c, void* buf, const void* own, const layout& L,
                     std::size_t esize) {
  const int n = c.n, me = c.me;
  if (own != nullptr && own != at(buf, L.off[me], esize))
    std::memcpy(at(buf, L.off[me], esize), own, L.len[me] * esize);
  if (n == 1) return;
  const int right = mod(me + 1, n), left = mod(me - 1, n);
  const std::size_t K = chunks_for(L, esize, c.tune);
  const std::size_t M = static_cast<std::size_t>(n - 1) * K;
  const std::size_t W = static_cast<std::size_t>(std::max(c.tune.window, 1)) * 2;
  auto recv_block = [&](std::size_t s) { return mod(me - static_cast<int>(s) - 1, n); };
  auto send_block = [&](std::size_t s) { return mod(me - static_cast<int>(s), n); };
  std::vector<p2p_request> recvs(W), sends;
  sends.reserve(M);
  auto post_recv = [&](std::size_t i) {
    if (i >= M) return;
    auto [lo, hi] = chunk_of(L, recv_block(i / K), i % K, K);
    recvs[i % W] = hi > lo ? c.irecv(left, at(buf, lo, esize), (hi - lo) * esize) : p2p_request{};
  };
  auto post_send = [&](std::size_t i) {
    auto [lo, hi] = chunk_of(L, send_block(i / K), i % K, K);
    if (hi > lo) sends.push_back(c.isend(right, at(buf, lo, esize), (hi - lo) * esize));
  };
  for (std::size_t i = 0; i < std::min(W, M); ++i) post_recv(i);
  for (std::size_t k = 0; k < K; ++k) post_send(k);
  for (std::size_t i = 0; i < M; ++i) {
    if (recvs[i % W].valid()) c.wait(recvs[i % W]);
    post_recv(i + W);
    if (i / K + 2 < static_cast<std::size_t>(n)) post_send(i + K);
  }
  c.wait_all(sends);
}

}  // namespace

void allreduce_ring(op_context& c, void* data, std::size_t count, dtype t, reduce_op op) {
  const layout L = even_split(count, c.n);
  const bool same = t == dtype::f32 || t == dtype::f64;
  const std::size_t tsz = dtype_size(t);
  const double divisor = op == reduce_op::avg ? c.n : 1.0;
  void* acc = same ? data : c.scratch->get(0, count * 4);
  ring_reduce_scatter(c, data, acc, at(data, L.off[c.me], tsz), L, t, op, divisor);
  ring_all_gather(c, data, nullptr, L, tsz);
}

void reduce_scatter(op_context& c, const void* in, void* out, std::size_t count, dtype t,
                    reduce_op op) {
  const layout L = uniform_blocks(count, c.n);
  const bool same = t == dtype::f32 || t == dtype::f64;
  const std::size_t asz = same ? dtype_size(t) : 4;
  const double divisor = op == reduce_op::avg ? c.n : 1.0;
  void* acc = c.n > 1 ? c.scratch->get(0, count * c.n * asz) : nullptr;
  ring_reduce_scatter(c, in, acc, out, L, t, op, divisor);
}

void all_gather(op_context& c, const void* in, void* out, std::size_t count, dtype t) {
  ring_all_gather(c, out, in, uniform_blocks(count, c.n), dtype_size(t));
}

}  // namespace troupe::collective::detail
