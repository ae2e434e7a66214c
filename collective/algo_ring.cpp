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

// What one ring pass does. Reduce-scatter (rs) of `src` (blocks by L, type t): partial sums go to
// `acc` (laid out like src, in t for f32/f64, in f32 for 16-bit; acc may equal src for an in-place
// f32/f64 allreduce); block me ends in `out` (len[me] elements of t), divided by `divisor` (avg).
// All-gather (ag) in place over `buf` (blocks by L, type t), block me already in buf. With both,
// `out` must be block me of `buf` (the allreduce), and the all-gather starts chunk by chunk as the
// reduce-scatter finishes them: chunk k of block me is sent on as soon as it is reduced.
struct ring_pass {
  const void* src = nullptr;
  void* acc = nullptr;
  void* out = nullptr;
  void* buf = nullptr;
  bool rs = false, ag = false;
  double divisor = 1.0;
};

// n == 1: the reduce-scatter is a copy (and the division of avg).
void ring_single(op_context& c, const ring_pass& p, const layout& L, dtype t) {
  const bool same = t == dtype::f32 || t == dtype::f64;
  const std::size_t tsz = dtype_size(t), len = L.len[0];
  if (!p.rs) return;
  if (p.out != p.src) std::memmove(p.out, at(p.src, L.off[0], tsz), len * tsz);
  if (p.divisor == 1.0) return;
  if (same) {
    divide(p.out, len, t, p.divisor);
  } else {
    float* f = static_cast<float*>(c.scratch->get(2, len * 4));
    widen(f, static_cast<const std::uint16_t*>(p.out), len, t);
    narrow(static_cast<std::uint16_t*>(p.out), f, len, t, static_cast<float>(p.divisor));
  }
}

// The ring pass: messages i = step * K + chunk run in that order on both sides (the transport's
// per-pair FIFO matching needs it), reduce-scatter steps first, then all-gather steps. Message i's
// send (i >= K) is posted as soon as message i - K has been received (and reduced): the data it
// carries is exactly what that receive completed.
void ring_run(op_context& c, const ring_pass& p, const layout& L, dtype t, reduce_op op) {
  const int n = c.n, me = c.me;
  if (n == 1) return ring_single(c, p, L, t);
  const bool same = t == dtype::f32 || t == dtype::f64;
  const std::size_t tsz = dtype_size(t), asz = same ? tsz : 4;
  const int right = mod(me + 1, n), left = mod(me - 1, n);
  const std::size_t K = chunks_for(L, p.rs ? asz : tsz, c.tune);
  const std::size_t S1 = static_cast<std::size_t>(n - 1);  // steps per phase
  const std::size_t rs_steps = p.rs ? S1 : 0;
  const std::size_t M = (rs_steps + (p.ag ? S1 : 0)) * K;  // messages each way
  const std::size_t W = static_cast<std::size_t>(std::max(c.tune.window, 1));
  const std::size_t slot_elems = (L.max_len + K - 1) / K + 1;
  char* slots = p.rs ? static_cast<char*>(c.scratch->get(1, W * slot_elems * asz)) : nullptr;
  auto slot = [&](std::size_t i) { return slots + (i % W) * slot_elems * asz; };
  // Block received / sent by message i (reduce-scatter: me-s-2 / me-s-1; all-gather: me-s-1 /
  // me-s, with s the step within the phase).
  auto recv_block = [&](std::size_t i) {
    const std::size_t g = i / K;
    return g < rs_steps ? mod(me - static_cast<int>(g) - 2, n)
                        : mod(me - static_cast<int>(g - rs_steps) - 1, n);
  };
  auto send_block = [&](std::size_t i) {
    const std::size_t g = i / K;
    return g < rs_steps ? mod(me - static_cast<int>(g) - 1, n)
                        : mod(me - static_cast<int>(g - rs_steps), n);
  };

  std::vector<p2p_request> recvs(W), sends;
  sends.reserve(M);
  auto post_recv = [&](std::size_t i) {
    if (i >= M) return;
    auto [lo, hi] = chunk_of(L, recv_block(i), i % K, K);
    if (hi == lo) {
      recvs[i % W] = p2p_request{};
    } else if (i / K < rs_steps) {
      recvs[i % W] = c.irecv(left, slot(i), (hi - lo) * asz);
    } else {
      recvs[i % W] = c.irecv(left, at(p.buf, lo, tsz), (hi - lo) * tsz);
    }
  };
  auto post_send = [&](std::size_t i) {
    if (i >= M) return;
    const std::size_t g = i / K;
    auto [lo, hi] = chunk_of(L, send_block(i), i % K, K);
    if (hi == lo) return;
    if (g >= rs_steps)
      sends.push_back(c.isend(right, at(p.buf, lo, tsz), (hi - lo) * tsz));
    else if (g == 0 && same)
      sends.push_back(c.isend(right, at(p.src, lo, tsz), (hi - lo) * asz));
    else
      sends.push_back(
          c.isend(right, at(static_cast<const void*>(p.acc), lo, asz), (hi - lo) * asz));
  };

  for (std::size_t i = 0; i < std::min(W, M); ++i) post_recv(i);
  if (p.rs && !same) {  // step 0 sends the own block widened to f32
    const int b = send_block(0);
    widen(reinterpret_cast<float*>(at(p.acc, L.off[b], 4)),
          reinterpret_cast<const std::uint16_t*>(at(p.src, L.off[b], tsz)), L.len[b], t);
  }
  for (std::size_t k = 0; k < K; ++k) post_send(k);

  for (std::size_t i = 0; i < M; ++i) {
    const std::size_t g = i / K;
    auto [lo, hi] = chunk_of(L, recv_block(i), i % K, K);
    if (hi > lo) {
      c.wait(recvs[i % W]);
      if (g < rs_steps) {
        const std::size_t len = hi - lo;
        const void* own = at(p.src, lo, tsz);
        if (g + 1 < rs_steps) {  // a partial sum, passed on at the next step
          if (same)
            reduce_same(at(p.acc, lo, asz), slot(i), own, len, t, op);
          else
            reduce_widen(reinterpret_cast<float*>(at(p.acc, lo, 4)),
                         reinterpret_cast<const float*>(slot(i)),
                         static_cast<const std::uint16_t*>(own), len, t, op);
        } else {  // the last step: this chunk of block me is complete
          void* dst = at(p.out, lo - L.off[me], tsz);
          if (same) {
            reduce_same(dst, slot(i), own, len, t, op);
            if (p.divisor != 1.0) divide(dst, len, t, p.divisor);
          } else {
            reduce_narrow(static_cast<std::uint16_t*>(dst), reinterpret_cast<const float*>(slot(i)),
                          static_cast<const std::uint16_t*>(own), len, t, op,
                          static_cast<float>(p.divisor));
          }
        }
      }
    }
    post_recv(i + W);
    post_send(i + K);
  }
  c.wait_all(sends);
}

}  // namespace

void allreduce_ring(op_context& c, void* data, std::size_t count, dtype t, reduce_op op) {
  const layout L = even_split(count, c.n);
  const bool same = t == dtype::f32 || t == dtype::f64;
  ring_pass p;
  p.src = data;
  p.acc = same ? data : c.scratch->get(0, count * 4);
  p.out = at(data, L.off[c.me], dtype_size(t));
  p.buf = data;
  p.rs = p.ag = true;
  p.divisor = op == reduce_op::avg ? c.n : 1.0;
  ring_run(c, p, L, t, op);
}

void reduce_scatter(op_context& c, const void* in, void* out, std::size_t count, dtype t,
                    reduce_op op) {
  if (direct_ready(c, "reduce_scatter", c.tune.pull_direct, count * c.n * dtype_size(t),
                   c.tune.reduce_scatter_direct_min))
    return reduce_scatter_direct(c, in, out, count, t, op);
  const bool same = t == dtype::f32 || t == dtype::f64;
  const std::size_t asz = same ? dtype_size(t) : 4;
  ring_pass p;
  p.src = in;
  p.acc = c.n > 1 ? c.scratch->get(0, count * c.n * asz) : nullptr;
  p.out = out;
  p.rs = true;
  p.divisor = op == reduce_op::avg ? c.n : 1.0;
  ring_run(c, p, uniform_blocks(count, c.n), t, op);
}

void all_gather(op_context& c, const void* in, void* out, std::size_t count, dtype t) {
  const std::size_t total = count * c.n * dtype_size(t);
  const bool direct =
      direct_ready(c, "all_gather", c.tune.pull_direct, total, c.tune.all_gather_direct_min);
  if (shm_ready(c, total)) return all_gather_shm(c, in, out, count, t);
  if (direct) return all_gather_direct(c, in, out, count, t);
  const std::size_t esize = dtype_size(t);
  void* own = at(out, count * c.me, esize);
  if (own != in) std::memcpy(own, in, count * esize);
  ring_pass p;
  p.buf = out;
  p.ag = true;
  ring_run(c, p, uniform_blocks(count, c.n), t, reduce_op::sum);
}

}  // namespace troupe::collective::detail
