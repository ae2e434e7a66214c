// The direct allreduce between processes of one host: the data moves by process_vm_readv and
// process_vm_writev (CMA) straight between the ranks' buffers; messages over the transport only
// synchronise.
//
// Rank me owns slice me of the buffer (an even split) in EVERY rank's buffer. Per op:
//   1. hello: every rank sends every peer its pid, the buffer's address, count, dtype and op
//      (a mismatch fails the op naming both ranks);
//   2. for each piece (direct_piece_bytes) of slice me: read that piece of every peer into a small
//      scratch buffer and reduce it into the own buffer at once (16-bit types accumulate in f32 and
//      round once), then write the finished piece into every peer's buffer while it is hot in
//      cache. Only rank me reads or writes slice me of any buffer other than its own, and nobody
//      else touches slice me of its own buffer, so no two ranks race on a byte; a piece is written
//      into a peer only after rank me read that peer's input there;
//   3. "done with your buffer" to every peer, and wait for the same from every peer: a rank
//      returns (and lets its caller touch the buffer) only when every slice has arrived and nobody
//      reads or writes its buffer any more.
// A rank whose op fails (abort, its timeout, a copy that fails, a lost peer) sends "stop" instead
// of "done" (one end message per pair per op, naming the rank whose failure stopped the op) and,
// before it throws, waits until every peer's end message arrived, the peer is lost, or its process
// is gone. Peers test the pre-posted end receives between pieces: a "stop" makes them stop
// pushing, send their own "stop" and fail naming that rank. So a failed op returns only when no
// live peer writes into its buffer any more, with one residual case: a peer that neither answers
// nor dies within the bound (the op's timeout, at least 1 s; without a timeout, until the
// membership layer declares it lost) may still write; the rank then says so on stderr.
// Pushing the finished piece (instead of letting the owners of the other slices pull it after a
// "slice final" message) saves a round of messages and a pass over the data that is no longer in
// cache: 2-rank 1 MiB allreduce 220 -> 98 us, 4 ranks 512 KiB 320 -> 170 us (collective/README.md).
// Messages between a pair on the op's tag arrive in posting order (transport.hpp), so the two
// kinds need no header. A peer that dies makes the copy fail with ESRCH, reported as "rank k lost:
// ..." like the transport's own loss; waits on a lost peer fail through the transport. Each slice
// is reduced by one rank, so every rank ends with bitwise the same result.
//
// Whether the path can be used is decided once per communicator, by a probe (direct_sync.cpp,
// which also holds the hello and end rounds and the stop protocol shared with the pull ops of
// algo_direct_pull.cpp).
//
// Not handled: a buffer in memory that process_vm_readv/writev cannot reach (VM_IO or VM_PFNMAP
// mappings, e.g. some device or driver memory mapped into the process) makes every copy fail with
// EFAULT and the op fails, where the ring (plain messages) would work; use allreduce_direct =
// false for such buffers. Falling back per op is not safe once any piece was pushed (it already
// overwrote that slice of a peer's input with the result).
#include <algorithm>

#include "collective/algo.hpp"
#include "collective/reduce.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

namespace {

// 2. Slice me piece by piece: read every peer's piece into scratch and reduce it into the own
// buffer, then write the result into every peer. Between pieces, stops when a peer said "stop".
void reduce_and_push(op_context& c, void* data, std::size_t count, dtype t, reduce_op op,
                     std::vector<p2p_request>& ends) {
  const int n = c.n, me = c.me;
  const std::size_t tsz = dtype_size(t);
  const bool same = t == dtype::f32 || t == dtype::f64;
  auto* base = static_cast<char*>(data);
  const std::vector<direct_msg>& in = c.direct->in;
  std::vector<char> seen(n, 0);
  const std::size_t lo = count * me / n, hi = count * (me + 1) / n;
  const std::size_t piece = std::max<std::size_t>(c.tune.direct_piece_bytes / tsz, 1);
  char* tmp = static_cast<char*>(c.scratch->get(0, piece * tsz));
  float* acc = same ? nullptr : static_cast<float*>(c.scratch->get(1, piece * 4));
  const float divisor = op == reduce_op::avg ? static_cast<float>(n) : 1.0f;
  for (std::size_t off = lo; off < hi; off += piece) {
    c.check();
    poll_stops(c, ends, seen);
    const std::size_t len = std::min(piece, hi - off);
    char* own = base + off * tsz;
    if (!same) widen(acc, reinterpret_cast<const std::uint16_t*>(own), len, t);
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      copy_peer(c, g, tmp, in[g].addr + off * tsz, len * tsz);
      const auto* b16 = reinterpret_cast<const std::uint16_t*>(tmp);
      if (same)
        reduce_same(own, own, tmp, len, t, op);
      else if (j + 1 < n)
        reduce_widen(acc, acc, b16, len, t, op);
      else
        reduce_narrow(reinterpret_cast<std::uint16_t*>(own), acc, b16, len, t, op, divisor);
    }
    if (same && op == reduce_op::avg) divide(own, len, t, n);
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      copy_peer(c, g, own, in[g].addr + off * tsz, len * tsz, true);
    }
  }
}

}  // namespace

bool allreduce_direct_ready(op_context& c, std::size_t count, std::size_t bytes) {
  return direct_ready(c, "allreduce", c.tune.allreduce_direct, bytes,
                      c.tune.allreduce_direct_min) &&
         count >= static_cast<std::size_t>(c.n);
}

void allreduce_direct(op_context& c, void* data, std::size_t count, dtype t, reduce_op op) {
  direct_state& d = *c.direct;
  const std::int32_t kind = direct_kind(op_kind::allreduce, t, op);
  for (direct_msg& m : d.outs)
    m = direct_msg{0, reinterpret_cast<std::uint64_t>(data), count, 0, 0, kind};
  direct_round(
      c, [] {},
      [&](int g) {
        TROUPE_CHECK(d.in[g].count == count && d.in[g].kind == kind, "direct allreduce: rank ",
                     c.ranks[g], " issued ", d.in[g].count, " elements (op code ", d.in[g].kind,
                     ") but rank ", c.ranks[c.me], " issued ", count, " (op code ", kind, ")");
      },
      [&](std::vector<p2p_request>& ends) { reduce_and_push(c, data, count, t, op, ends); });
}

}  // namespace troupe::collective::detail
