// The op context's waiting, and the latency-bound algorithms: recursive-doubling allreduce,
// binomial-tree and chained broadcast, pairwise all-to-all(v), dissemination barrier.
#include <algorithm>
#include <cstring>
#include <limits>
#include <thread>

#include <sched.h>

#include "collective/algo.hpp"
#include "collective/reduce.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

inline int mod(int a, int n) {
  return ((a % n) + n) % n;
}

// How long one blocking transport wait may last before the op looks at abort, lost members and
// its deadline again. Bounds how late abort() is noticed by an op blocked on a live peer.
constexpr std::chrono::milliseconds wait_slice{20};

}  // namespace

void* scratch_pool::get(int slot, std::size_t bytes) {
  buf& b = bufs_[slot];
  if (b.size < bytes) {
    b.p.reset();  // free first: the old buffer may be large
    b.p.reset(new std::byte[bytes]);
    b.size = bytes;
  }
  return b.p.get();
}

void op_context::check() const {
  if (cancelled != nullptr && cancelled->load(std::memory_order_relaxed))
    throw troupe::error("aborted");
  for (int g = 0; g < n; ++g) {
    if (g == me) continue;
    std::string why = t.peer_failure(ranks[g]);
    if (!why.empty()) throw troupe::error("rank " + std::to_string(ranks[g]) + " lost: " + why);
  }
  if (collective) shm_check_ops(*this);
  if (std::chrono::steady_clock::now() > deadline)
    throw deadline_error("timed out after " + std::to_string(timeout.count()) +
                         " ms between messages of the op");
}

void op_context::note_done(const p2p_request& r) {
  const detail::p2p_state* s = r.state();
  if (heard == nullptr || s == nullptr || s->is_send) return;
  for (int g = 0; g < n; ++g)
    if (ranks[g] == s->peer && static_cast<std::size_t>(g) < heard->size()) (*heard)[g] = 1;
}

std::string op_context::waiting_for(const p2p_request& r) const {
  const detail::p2p_state* s = r.state();
  if (s == nullptr) return "?";
  const std::string b = std::to_string(s->bytes) + " bytes";
  return "rank " + std::to_string(s->peer) +
         (s->is_send ? " (it has not taken this rank's message of " + b + ")"
                     : " (its message of " + b + " has not arrived)");
}

void op_context::wait(p2p_request& r) {
  if (!r.valid()) return;
  // On a single allowed CPU, yield between polls for a while: the transport's wait spins ~50 us
  // before it yields, which starves a peer or helper thread on the same CPU. Otherwise straight
  // into the transport's wait, which spins before it sleeps: polling with test() here would fight
  // a transport's own progress thread for the worker (see the UCX transport).
  if (yield_poll)
    for (int i = 0; i < 256; ++i) {
      if (t.test(r)) {
        note_done(r);
        return;
      }
      sched_yield();
    }
  for (;;) {
    auto slice = wait_slice;
    if (deadline != std::chrono::steady_clock::time_point::max()) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      slice = std::clamp(left, std::chrono::milliseconds{1}, wait_slice);
    }
    try {
      t.wait(r, slice);
      note_done(r);
      return;
    } catch (const troupe::error&) {
      // Either the request failed (test rethrows its error) or the slice ran out.
      if (t.test(r)) {
        note_done(r);
        return;
      }
    }
    try {
      check();
    } catch (const deadline_error&) {
      throw deadline_error("waiting for " + waiting_for(r));
    }
  }
}

void op_context::wait_all(std::vector<p2p_request>& rs) {
  for (std::size_t i = 0; i < rs.size(); ++i) {
    try {
      wait(rs[i]);
    } catch (const deadline_error& e) {
      // Name every rank this op still waits for here, not only the first.
      std::string more;
      for (std::size_t j = i + 1; j < rs.size(); ++j) {
        bool done = !rs[j].valid();
        try {
          done = done || t.test(rs[j]);
        } catch (const troupe::error&) {
          done = true;  // failed: its own error is not the deadline's
        }
        if (!done) more += ", " + waiting_for(rs[j]);
      }
      throw deadline_error(e.what() + more);
    }
  }
}

void allreduce(op_context& c, void* data, std::size_t count, dtype t, reduce_op op) {
  if (allreduce_direct_ready(c, count, count * dtype_size(t)))
    allreduce_direct(c, data, count, t, op);
  else if (count * dtype_size(t) < c.tune.allreduce_ring_min ||
           count < static_cast<std::size_t>(c.n))
    allreduce_recursive_doubling(c, data, count, t, op);
  else
    allreduce_ring(c, data, count, t, op);
}

// Recursive doubling on the largest power of two p2 <= n. The first 2*(n-p2) ranks pair up first:
// each even one hands its vector to the odd one above it and sits out, getting the result back
// at the end. Partners combine (lower rank's vector, higher rank's vector) in that order, so both
// hold bitwise the same result after every step.
void allreduce_recursive_doubling(op_context& c, void* data, std::size_t count, dtype t,
                                  reduce_op op) {
  const bool same = t == dtype::f32 || t == dtype::f64;
  const dtype at = same ? t : dtype::f32;
  const std::size_t bytes = count * dtype_size(at);
  const int n = c.n, me = c.me;
  void* w = data;
  if (!same) {
    w = c.scratch->get(0, bytes);
    widen(static_cast<float*>(w), static_cast<const std::uint16_t*>(data), count, t);
  }
  if (n > 1 && count > 0) {
    void* tmp = c.scratch->get(1, bytes);
    int p2 = 1;
    while (p2 * 2 <= n) p2 *= 2;
    const int rem = n - p2;
    int vr;
    if (me < 2 * rem) {
      if (me % 2 == 0) {
        auto s = c.isend(me + 1, w, bytes);
        c.wait(s);
        vr = -1;
      } else {
        auto r = c.irecv(me - 1, tmp, bytes);
        c.wait(r);
        reduce_same(w, tmp, w, count, at, op);
        vr = me / 2;
      }
    } else {
      vr = me - rem;
    }
    if (vr >= 0) {
      for (int mask = 1; mask < p2; mask <<= 1) {
        const int pv = vr ^ mask;
        const int peer = pv < rem ? pv * 2 + 1 : pv + rem;
        auto r = c.irecv(peer, tmp, bytes);
        auto s = c.isend(peer, w, bytes);
        c.wait(r);
        c.wait(s);
        if (peer < me)
          reduce_same(w, tmp, w, count, at, op);
        else
          reduce_same(w, w, tmp, count, at, op);
      }
    }
    if (me < 2 * rem) {
      if (me % 2 == 0) {
        auto r = c.irecv(me + 1, w, bytes);
        c.wait(r);
      } else {
        auto s = c.isend(me - 1, w, bytes);
        c.wait(s);
      }
    }
  }
  const double divisor = op == reduce_op::avg ? n : 1.0;
  if (same) {
    if (divisor != 1.0) divide(data, count, t, divisor);
  } else {
    narrow(static_cast<std::uint16_t*>(data), static_cast<const float*>(w), count, t,
           static_cast<float>(divisor));
  }
}

// Small, or two ranks: binomial tree rooted at `root` (with two ranks, one message: chunks would
// only add rendezvous handshakes, there is nobody to forward to). Large: a chain root -> root+1 ->
// ... in chunks, each rank forwarding chunk k as soon as it has it (later receives posted).
void broadcast(op_context& c, void* data, std::size_t count, dtype t, int root) {
  const int n = c.n;
  const std::size_t esize = dtype_size(t), bytes = count * esize;
  if (n == 1 || bytes == 0) return;
  const int vr = mod(c.me - root, n);
  auto real = [&](int v) { return mod(v + root, n); };
  std::vector<p2p_request> sends;
  if (bytes < c.tune.broadcast_chain_min || n == 2) {
    int mask = 1;
    while (mask < n) {
      if (vr & mask) {
        auto r = c.irecv(real(vr - mask), data, bytes);
        c.wait(r);
        break;
      }
      mask <<= 1;
    }
    for (mask >>= 1; mask > 0; mask >>= 1)
      if (vr + mask < n) sends.push_back(c.isend(real(vr + mask), data, bytes));
    c.wait_all(sends);
    return;
  }
  const std::size_t K =
      std::max<std::size_t>((bytes + c.tune.chunk_bytes - 1) / c.tune.chunk_bytes, 1);
  auto lo = [&](std::size_t k) { return count * k / K * esize; };
  char* p = static_cast<char*>(data);
  const bool forward = vr + 1 < n;
  sends.reserve(K);
  if (vr == 0) {
    for (std::size_t k = 0; k < K; ++k)
      sends.push_back(c.isend(real(1), p + lo(k), lo(k + 1) - lo(k)));
  } else {
    const std::size_t W = static_cast<std::size_t>(std::max(c.tune.window, 1)) * 2;
    std::vector<p2p_request> recvs(W);
    for (std::size_t k = 0; k < std::min(W, K); ++k)
      recvs[k] = c.irecv(real(vr - 1), p + lo(k), lo(k + 1) - lo(k));
    for (std::size_t k = 0; k < K; ++k) {
      c.wait(recvs[k % W]);
      if (k + W < K) recvs[k % W] = c.irecv(real(vr - 1), p + lo(k + W), lo(k + W + 1) - lo(k + W));
      if (forward) sends.push_back(c.isend(real(vr + 1), p + lo(k), lo(k + 1) - lo(k)));
    }
  }
  c.wait_all(sends);
}

// Pairwise exchange: step s receives from me-s and sends to me+s, so at every step each rank
// talks to a different peer; all steps are posted at once and the transport overlaps them.
// all_to_allv first exchanges, with every peer, the pair's counts (what each sends the other), so
// that a pair whose counts differ is known to both of its ranks: they move nothing that way, finish
// the rest of the op with everybody else and then fail naming the pair (no rank waits for a
// message that will not come, nor leaves one unreceived).
void all_to_allv(op_context& c, op_kind k, const void* in,
                 const std::vector<std::size_t>& send_counts, void* out,
                 const std::vector<std::size_t>& recv_counts, dtype t) {
  const int n = c.n, me = c.me;
  const std::size_t esize = dtype_size(t);
  const bool varied = k == op_kind::all_to_allv;
  const std::vector<std::size_t> soff = offsets_of(send_counts), roff = offsets_of(recv_counts);
  // The direct path from all_to_all_direct_min bytes: all_to_all's size is the same on every rank;
  // all_to_allv's differ, so it decides on the largest send buffer of any rank, which every rank
  // learns in the count check below (the same choice everywhere).
  const bool direct = direct_ready(c, op_kind_name(k), c.tune.pull_direct, 0, 0);
  if (!varied && shm_ready(c, soff[n] * esize))
    return all_to_allv_shm(c, k, in, send_counts, out, recv_counts, t);
  // all_to_allv: staged at every size where the segments exist (its count check rides in the
  // records there, so no message round, and no rank needs the others' sizes to pick the path).
  if (varied && shm_ready(c, std::numeric_limits<std::size_t>::max()))
    return all_to_allv_shm(c, k, in, send_counts, out, recv_counts, t);
  if (!varied && direct && soff[n] * esize >= c.tune.all_to_all_direct_min)
    return all_to_allv_direct(c, k, in, send_counts, out, recv_counts, t);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  std::vector<p2p_request> recvs, sends;
  recvs.reserve(n);
  sends.reserve(n);
  std::vector<char> skip_send(n, 0), skip_recv(n, 0);
  std::string mismatch;
  std::uint64_t largest = 0;  // all_to_allv: the largest send buffer of any rank, in bytes
  if (varied && n > 1) {
    // Per peer g: [what this rank sends g, what it expects from g, the bytes this rank sends in
    // all], and g's (in scratch: a late message after a failed op must not land on a stack that
    // is gone).
    constexpr int w = 3;
    auto* counts =
        static_cast<std::uint64_t*>(c.scratch->get(3, 2 * w * n * sizeof(std::uint64_t)));
    std::uint64_t *mine = counts, *theirs = counts + w * n;
    for (int s = 1; s < n; ++s) {
      const int g = mod(me - s, n);
      recvs.push_back(c.irecv(g, theirs + w * g, w * sizeof(std::uint64_t)));
    }
    for (int s = 1; s < n; ++s) {
      const int g = mod(me + s, n);
      mine[w * g] = send_counts[g];
      mine[w * g + 1] = recv_counts[g];
      mine[w * g + 2] = soff[n] * esize;
      sends.push_back(c.isend(g, mine + w * g, w * sizeof(std::uint64_t)));
    }
    c.wait_all(recvs);
    c.wait_all(sends);
    recvs.clear();
    sends.clear();
    largest = soff[n] * esize;
    for (int g = 0; g < n; ++g)
      if (g != me) largest = std::max(largest, theirs[w * g + 2]);
    for (int g = 0; g < n; ++g) {
      if (g == me) continue;
      const std::string who = std::to_string(c.ranks[g]), self = std::to_string(c.ranks[me]);
      if (theirs[w * g] != recv_counts[g]) {
        skip_recv[g] = 1;
        if (mismatch.empty())
          mismatch = "all_to_allv: rank " + who + " sends " + std::to_string(theirs[w * g]) +
                     " elements to rank " + self + ", which expects " +
                     std::to_string(recv_counts[g]) + " from it";
      }
      if (theirs[w * g + 1] != send_counts[g]) {
        skip_send[g] = 1;
        if (mismatch.empty())
          mismatch = "all_to_allv: rank " + self + " sends " + std::to_string(send_counts[g]) +
                     " elements to rank " + who + ", which expects " +
                     std::to_string(theirs[w * g + 1]) + " from it";
      }
    }
  }
  if (varied && n > 1) {
    // The pull path fails both ranks of a pair whose counts differ in its hello check, the rest
    // through its stop protocol.
    if (direct && largest >= c.tune.all_to_all_direct_min)
      return all_to_allv_direct(c, k, in, send_counts, out, recv_counts, t);
  }
  for (int s = 1; s < n; ++s) {
    const int from = mod(me - s, n);
    if (recv_counts[from] > 0 && !skip_recv[from])
      recvs.push_back(c.irecv(from, dst + roff[from] * esize, recv_counts[from] * esize));
  }
  for (int s = 1; s < n; ++s) {
    const int to = mod(me + s, n);
    if (send_counts[to] > 0 && !skip_send[to])
      sends.push_back(c.isend(to, src + soff[to] * esize, send_counts[to] * esize));
  }
  if (send_counts[me] > 0)
    std::memmove(dst + roff[me] * esize, src + soff[me] * esize, send_counts[me] * esize);
  c.wait_all(recvs);
  c.wait_all(sends);
  if (!mismatch.empty()) throw troupe::error(mismatch);
}

// Dissemination: in round k every rank signals me+2^k and waits for me-2^k; after ceil(log2 n)
// rounds every rank has heard, transitively, from all.
void barrier(op_context& c) {
  const int n = c.n, me = c.me;
  char out = 1, in = 0;
  for (int k = 1; k < n; k <<= 1) {
    auto r = c.irecv(mod(me - k, n), &in, 1);
    auto s = c.isend(mod(me + k, n), &out, 1);
    c.wait(r);
    c.wait(s);
  }
}

}  // namespace troupe::collective::detail
