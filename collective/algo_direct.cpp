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
// Whether the path can be used is decided once per communicator, at its first allreduce
// (allreduce_direct_ready): every member on this host (transport::same_host, which includes the
// pid namespace), then a probe in which every rank reads a word of every peer (it must hold
// magic ^ pid) and writes it back, and all ranks exchange verdicts. The probe also checks that
// every rank has the same allreduce_direct and allreduce_direct_min (else the first allreduce
// fails naming the ranks and the setting); a later set_tuning that differs between ranks is not
// caught (the ranks pick different algorithms for an op and fail or hang).
// Where any rank fails - the kernel refuses (Yama ptrace_scope, seccomp: EPERM, EACCES, ENOSYS),
// or the pid means another process (ranks in different pid namespaces: ESRCH, EFAULT or a wrong
// word) - the communicator keeps to the ring and says so once on stderr.
//
// Not handled: a buffer in memory that process_vm_readv/writev cannot reach (VM_IO or VM_PFNMAP
// mappings, e.g. some device or driver memory mapped into the process) makes every copy fail with
// EFAULT and the op fails, where the ring (plain messages) would work; use allreduce_direct =
// false for such buffers. Falling back per op is not safe once any piece was pushed (it already
// overwrote that slice of a peer's input with the result).
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "collective/algo.hpp"
#include "collective/reduce.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

namespace {

constexpr std::uint64_t hello_magic = 0x74726f7570654441ull;  // "troupeDA"

// Copies `bytes` between `local` and `remote` in process `pid` (process_vm_readv, or
// process_vm_writev when `write`); 0 or the errno of the failure.
int try_copy(int pid, void* local, std::uint64_t remote, std::size_t bytes, bool write = false) {
  auto* p = static_cast<char*>(local);
  while (bytes > 0) {
    iovec l{p, bytes}, r{reinterpret_cast<void*>(remote), bytes};
    const ssize_t got =
        write ? process_vm_writev(pid, &l, 1, &r, 1, 0) : process_vm_readv(pid, &l, 1, &r, 1, 0);
    if (got > 0) {
      p += got;
      remote += static_cast<std::uint64_t>(got);
      bytes -= static_cast<std::size_t>(got);
    } else if (got < 0 && errno == EINTR) {
      continue;
    } else {
      return got < 0 ? errno : EIO;
    }
  }
  return 0;
}

std::string errno_text(int err) {
  return std::string(strerrorname_np(err) != nullptr ? strerrorname_np(err) : "?") + " (" +
         std::strerror(err) + ")";
}

// try_copy that throws: a lost peer as the transport reports it, else naming rank, pid, address.
void copy_peer(op_context& c, int g, int pid, void* local, std::uint64_t remote, std::size_t bytes,
               bool write = false) {
  const int err = try_copy(pid, local, remote, bytes, write);
  if (err == 0) return;
  const int w = c.ranks[g];
  const std::string lost = c.t.peer_failure(w);
  if (!lost.empty()) throw troupe::error("rank " + std::to_string(w) + " lost: " + lost);
  if (err == ESRCH)
    throw troupe::error("rank " + std::to_string(w) + " lost: its process (pid " +
                        std::to_string(pid) + ") is gone (" +
                        (write ? "process_vm_writev: " : "process_vm_readv: ") + errno_text(err) +
                        ")");
  char where[32];
  std::snprintf(where, sizeof where, "0x%llx", static_cast<unsigned long long>(remote));
  throw troupe::error(std::string("direct allreduce: ") + (write ? "writing " : "reading ") +
                      std::to_string(bytes) + " bytes of rank " + std::to_string(w) + " (pid " +
                      std::to_string(pid) + ") at " + where + " failed: " + errno_text(err));
}

// Posts a receive of one T from every peer into in[g] (in order me+1, me+2, ...).
template <typename T>
void recv_from_all(op_context& c, std::vector<T>& in, std::vector<p2p_request>& rs) {
  for (int j = 1; j < c.n; ++j) {
    const int g = (c.me + j) % c.n;
    rs[g] = c.irecv(g, &in[g], sizeof(T));
  }
}
template <typename T>
void send_to_all(op_context& c, const T& v, std::vector<p2p_request>& sends) {
  for (int j = 1; j < c.n; ++j) sends.push_back(c.isend((c.me + j) % c.n, &v, sizeof(T)));
}
void wait_from_all(op_context& c, std::vector<p2p_request>& rs) {
  for (int j = 1; j < c.n; ++j) c.wait(rs[(c.me + j) % c.n]);
}

// The one-time probe, at a communicator's first allreduce (whatever its size, so that every rank
// takes part): every rank sends its pid, the address of a probe word and its tuning of the direct
// path (allreduce_direct, allreduce_direct_min), which must agree (else every rank fails the op
// naming the ranks and the setting: the ranks would pick different algorithms and hang); then,
// where every member is on this host (`local`), can every rank read and write every peer's memory?
// Every rank ends with the same answer.
bool probe(op_context& c, direct_state& d, bool local) {
  const int n = c.n, me = c.me;
  d.probe = hello_magic ^ static_cast<std::uint64_t>(getpid());
  d.out = direct_msg{hello_magic, reinterpret_cast<std::uint64_t>(&d.probe),
                     c.tune.allreduce_direct_min, getpid(), c.tune.allreduce_direct ? 1 : 0};
  std::vector<p2p_request> rs(n), sends;
  recv_from_all(c, d.in, rs);
  send_to_all(c, d.out, sends);
  wait_from_all(c, rs);
  c.wait_all(sends);
  for (int g = 0; g < n; ++g) {
    if (g == me) continue;
    TROUPE_CHECK(d.in[g].kind == d.out.kind, "allreduce: rank ", c.ranks[g],
                 " has algo_tuning::allreduce_direct = ", d.in[g].kind, " but rank ", c.ranks[me],
                 " has ", d.out.kind, " (the tuning must be the same on every rank)");
    TROUPE_CHECK(d.in[g].count == d.out.count, "allreduce: rank ", c.ranks[g],
                 " has algo_tuning::allreduce_direct_min = ", d.in[g].count, " but rank ",
                 c.ranks[me], " has ", d.out.count, " (the tuning must be the same on every rank)");
  }
  // The verdict: addr 1 where not every member is on this host; count: the errno of the first
  // failed copy, kind: the rank it tried.
  direct_msg mine{hello_magic, local ? 0u : 1u, 0, 0, -1};
  for (int j = 1; j < n && local && mine.count == 0; ++j) {
    const int g = (me + j) % n;
    std::uint64_t v = 0;
    int err = try_copy(d.in[g].pid, &v, d.in[g].addr, sizeof v);
    if (err == 0 && v != (hello_magic ^ static_cast<std::uint64_t>(d.in[g].pid))) err = EIO;
    if (err == 0) err = try_copy(d.in[g].pid, &v, d.in[g].addr, sizeof v, true);  // same value
    if (err != 0) mine = direct_msg{hello_magic, 0, static_cast<std::uint64_t>(err), 0, c.ranks[g]};
  }
  d.out = mine;
  sends.clear();
  recv_from_all(c, d.in, rs);
  send_to_all(c, d.out, sends);
  wait_from_all(c, rs);
  c.wait_all(sends);
  d.in[me] = mine;
  for (int g = 0; g < n; ++g)
    if (d.in[g].addr != 0) return false;
  for (int g = 0; g < n; ++g) {
    if (d.in[g].count == 0) continue;
    if (me == 0 && c.tune.allreduce_direct)
      std::fprintf(stderr,
                   "troupe: %s: direct allreduce off, using the ring: rank %d cannot access rank "
                   "%d's memory (process_vm_readv/writev: %s)\n",
                   d.comm_name.c_str(), c.ranks[g], d.in[g].kind,
                   errno_text(static_cast<int>(d.in[g].count)).c_str());
    return false;
  }
  return true;
}

// Every rank sends every peer one end message per op (direct_state): "done" (it will not touch
// the peer's buffer again) or "stop" (its op failed: the peer must stop too). Throws when peer g's
// end message (arrived) says "stop".
void throw_if_stopped(op_context& c, direct_state& d, int g) {
  const std::uint32_t code = d.finished[g];
  if (code < 2) return;
  d.stopped_by = code;
  const std::string who = "rank " + std::to_string((code - 2) / 2);
  const std::string by = " (told by rank " + std::to_string(c.ranks[g]) + ")";
  if ((code - 2) % 2 == 1) throw troupe::error(who + " lost: its process is gone" + by);
  throw troupe::error("direct allreduce: " + who + " failed its part of the op and stopped it" +
                      by);
}

// Whether peer g is lost or its process is gone (then it writes nothing any more).
bool peer_gone(op_context& c, direct_state& d, int g, bool hellos) {
  std::uint8_t b;
  return !c.t.peer_failure(c.ranks[g]).empty() ||
         (hellos && try_copy(d.in[g].pid, &b, d.in[g].addr, 1) == ESRCH);
}

// Between pieces: a cheap test of the pre-posted end messages; throws when a peer said "stop".
void poll_stops(op_context& c, direct_state& d, std::vector<p2p_request>& ends,
                std::vector<char>& seen) {
  for (int j = 1; j < c.n; ++j) {
    const int g = (c.me + j) % c.n;
    if (seen[g] || !c.t.test(ends[g])) continue;
    seen[g] = 1;
    throw_if_stopped(c, d, g);
  }
}

// After this rank's op failed: tells every peer to stop (unless it already said "done") and waits
// until each peer's end message ("done" or "stop") arrived, the peer is lost, or its process is
// gone, so that no peer writes into this rank's buffer after the op returns. The wait ignores
// abort() and the op's deadline (either may be why the op failed) and is bounded by the op's
// timeout (at least 1 s) where it has one, else only by the membership layer declaring the peer
// lost; a peer that neither answers nor dies within that bound is the residual case (logged).
void stop_peers(op_context& c, direct_state& d, std::vector<p2p_request>& ends, bool hellos,
                bool sent_done) noexcept {
  using clock = std::chrono::steady_clock;
  const auto until = c.timeout.count() > 0
                         ? clock::now() + std::max(c.timeout, std::chrono::milliseconds{1000})
                         : clock::time_point::max();
  // Relay the "stop" that stopped this rank, else name a lost peer, else this rank.
  d.stop = d.stopped_by != 0 ? d.stopped_by : 2 + 2 * static_cast<std::uint32_t>(c.ranks[c.me]);
  for (int g = 0; g < c.n && d.stopped_by == 0; ++g)
    if (g != c.me && peer_gone(c, d, g, hellos)) {
      d.stop = 3 + 2 * static_cast<std::uint32_t>(c.ranks[g]);
      break;
    }
  for (int j = 1; j < c.n && !sent_done; ++j) {
    try {
      c.t.isend(c.ranks[(c.me + j) % c.n], c.tag, &d.stop, sizeof d.stop);
    } catch (const std::exception&) {  // a lost peer: nothing to tell it
    }
  }
  for (int j = 1; j < c.n; ++j) {
    const int g = (c.me + j) % c.n;
    for (;;) {
      try {
        if (c.t.test(ends[g])) break;
        c.t.wait(ends[g], std::chrono::milliseconds{2});
        break;
      } catch (const std::exception&) {
        try {
          if (c.t.test(ends[g])) break;
        } catch (const std::exception&) {
          break;  // the request failed: the peer is lost
        }
      }
      if (peer_gone(c, d, g, hellos)) break;
      if (clock::now() > until) {
        std::fprintf(stderr,
                     "troupe: %s: direct allreduce failed on rank %d and rank %d neither stopped "
                     "nor was lost within %lld ms: it may still write into rank %d's buffer\n",
                     d.comm_name.c_str(), c.ranks[c.me], c.ranks[g],
                     static_cast<long long>(c.timeout.count()), c.ranks[c.me]);
        break;
      }
    }
  }
}

// 2. Slice me piece by piece: read every peer's piece into scratch and reduce it into the own
// buffer, then write the result into every peer. Between pieces, stops when a peer said "stop".
void reduce_and_push(op_context& c, direct_state& d, void* data, std::size_t count, dtype t,
                     reduce_op op, std::vector<p2p_request>& ends) {
  const int n = c.n, me = c.me;
  const std::size_t tsz = dtype_size(t);
  const bool same = t == dtype::f32 || t == dtype::f64;
  auto* base = static_cast<char*>(data);
  const std::vector<direct_msg>& in = d.in;
  std::vector<char> seen(n, 0);
  const std::size_t lo = count * me / n, hi = count * (me + 1) / n;
  const std::size_t piece = std::max<std::size_t>(c.tune.direct_piece_bytes / tsz, 1);
  char* tmp = static_cast<char*>(c.scratch->get(0, piece * tsz));
  float* acc = same ? nullptr : static_cast<float*>(c.scratch->get(1, piece * 4));
  const float divisor = op == reduce_op::avg ? static_cast<float>(n) : 1.0f;
  for (std::size_t off = lo; off < hi; off += piece) {
    c.check();
    poll_stops(c, d, ends, seen);
    const std::size_t len = std::min(piece, hi - off);
    char* own = base + off * tsz;
    if (!same) widen(acc, reinterpret_cast<const std::uint16_t*>(own), len, t);
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      copy_peer(c, g, in[g].pid, tmp, in[g].addr + off * tsz, len * tsz);
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
      copy_peer(c, g, in[g].pid, own, in[g].addr + off * tsz, len * tsz, true);
    }
  }
}

}  // namespace

bool allreduce_direct_ready(op_context& c, std::size_t count, std::size_t bytes) {
  if (c.direct == nullptr || c.n < 2) return false;
  direct_state& d = *c.direct;
  if (d.m == direct_state::mode::unknown) {
    d.in.assign(c.n, direct_msg{});
    d.finished.assign(c.n, 0);
    bool local = true;
    for (int g = 0; g < c.n; ++g) local = local && (g == c.me || c.t.same_host(c.ranks[g]));
    d.m = probe(c, d, local) ? direct_state::mode::on : direct_state::mode::off;
  }
  return d.m == direct_state::mode::on && c.tune.allreduce_direct &&
         bytes >= c.tune.allreduce_direct_min && count >= static_cast<std::size_t>(c.n);
}

void allreduce_direct(op_context& c, void* data, std::size_t count, dtype t, reduce_op op) {
  const int n = c.n, me = c.me;
  direct_state& d = *c.direct;
  // 1. hello, and the receives of the "done"/"stop" messages (they match in posting order).
  d.out = direct_msg{hello_magic, reinterpret_cast<std::uint64_t>(data), count, getpid(),
                     static_cast<std::int32_t>(t) << 8 | static_cast<std::int32_t>(op)};
  std::fill(d.finished.begin(), d.finished.end(), std::uint32_t{0});
  d.stopped_by = 0;
  std::vector<p2p_request> hello_rs(n), finished_rs(n), sends;
  sends.reserve(2 * n);
  recv_from_all(c, d.in, hello_rs);
  recv_from_all(c, d.finished, finished_rs);
  bool hellos = false, sent_done = false;
  try {
    send_to_all(c, d.out, sends);
    wait_from_all(c, hello_rs);
    hellos = true;
    for (int g = 0; g < n; ++g) {
      if (g == me) continue;
      TROUPE_CHECK(
          d.in[g].magic == hello_magic && d.in[g].count == count && d.in[g].kind == d.out.kind,
          "direct allreduce: rank ", c.ranks[g], " issued ", d.in[g].count,
          " elements (type/op code ", d.in[g].kind, ") but rank ", c.ranks[me], " issued ", count,
          " (type/op code ", d.out.kind, ")");
    }
    reduce_and_push(c, d, data, count, t, op, finished_rs);
    // 3. Done with every peer's buffer; wait until every peer is done with this one.
    send_to_all(c, d.done, sends);
    sent_done = true;
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      c.wait(finished_rs[g]);
      throw_if_stopped(c, d, g);
    }
    c.wait_all(sends);
  } catch (...) {
    stop_peers(c, d, finished_rs, hellos, sent_done);
    throw;
  }
}

}  // namespace troupe::collective::detail
