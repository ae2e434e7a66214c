// The direct path's shared parts: the one-time probe, copies between processes, and the round of
// small messages around every direct op (hello, "done" or "stop"); the ops themselves are in
// algo_direct.cpp (allreduce) and algo_direct_pull.cpp (reduce_scatter, all_gather, all_to_all(v)).
//
// Whether the path can be used is decided once per communicator, at its first op that may take
// it (direct_ready): every member on this host (transport::same_host, which includes the pid
// namespace), then a probe in which every rank reads a word of every peer (it must hold
// magic ^ pid) and writes it back, and all ranks exchange verdicts. The probe also checks that
// every rank has the same direct tuning (allreduce_direct, pull_direct and the sizes from which
// each op goes direct; else that op fails on every rank naming the ranks and the setting); a later
// set_tuning that differs between ranks is not caught (the ranks pick different algorithms for an
// op and fail or hang). Where any rank fails - the kernel refuses (Yama ptrace_scope, seccomp:
// EPERM, EACCES, ENOSYS), or the pid means another process (ranks in different pid namespaces:
// ESRCH, EFAULT or a wrong word) - the communicator keeps to messages and says so once on stderr.
//
// Every direct op sends each peer one hello (pid, the address the peer is to read or write, count,
// what the op is) and one end message ("done with your buffer", or "stop"), matched in posting
// order on the op's tag (transport.hpp), so the two kinds need no header.
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>

#include "collective/algo.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

namespace {

constexpr std::uint64_t hello_magic = 0x74726f7570654441ull;  // "troupeDA"
constexpr std::uint64_t left_magic = 0x74726f7570654c46ull;   // "troupeLF"

// A state word that lives as long as the process: a peer may read it (process_vm_readv) after
// the communicator that owned it is gone. One per communicator that ever probed, followed by a
// word the probe's write test writes (a write into `state` could undo a "left" set meanwhile).
struct state_words {
  std::atomic<std::uint64_t> state{0};
  std::atomic<std::uint64_t> scratch{0};
};
static_assert(sizeof(state_words) == 16 && offsetof(state_words, scratch) == 8);
std::atomic<std::uint64_t>* new_state_word() {
  static std::mutex mu;
  static std::deque<state_words> words;  // never shrinks: addresses stay valid
  std::lock_guard lk(mu);
  return &words.emplace_back().state;
}

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

// The direct tuning every rank must share, as the probe's first round sends it.
constexpr std::array<const char*, 8> setup_names = {
    "allreduce_direct",      "allreduce_direct_min",      "pull_direct",
    "all_gather_direct_min", "reduce_scatter_direct_min", "all_to_all_direct_min",
    "shm (and shm_min)",     "shm_slot_bytes x shm_slots"};
std::array<std::uint64_t, 8> setup_of(const algo_tuning& t) {
  return {t.allreduce_direct ? 1u : 0u, t.allreduce_direct_min,
          t.pull_direct ? 1u : 0u,      t.all_gather_direct_min,
          t.reduce_scatter_direct_min,  t.all_to_all_direct_min,
          t.shm ? t.shm_min + 1 : 0u,   t.shm_slot_bytes * static_cast<std::uint64_t>(t.shm_slots)};
}

// The one-time probe (see the top of the file): every rank sends its pid, the address of a probe
// word and its direct tuning, which must agree; then, where every member is on this host
// (`local`), can every rank read and write every peer's memory? Every rank ends with the same
// answer.
bool probe(op_context& c, direct_state& d, bool local) {
  const int n = c.n, me = c.me;
  if (d.word == nullptr) d.word = new_state_word();
  d.word->store(hello_magic ^ static_cast<std::uint64_t>(getpid()), std::memory_order_release);
  // The shared-memory segment's descriptor (or ~0: none) travels in aux.
  const int fd = local && c.tune.shm ? shm_create(d, n, c.tune) : -1;
  d.out = direct_msg{hello_magic, reinterpret_cast<std::uint64_t>(d.word),
                     0,           fd >= 0 ? static_cast<std::uint64_t>(fd) : ~std::uint64_t{0},
                     getpid(),    0};
  d.tuning_in.assign(n, {});
  d.tuning_out = setup_of(c.tune);
  std::vector<p2p_request> rs(n), setup_rs(n), sends;
  recv_from_all(c, d.in, rs);
  recv_from_all(c, d.tuning_in, setup_rs);
  send_to_all(c, d.out, sends);
  send_to_all(c, d.tuning_out, sends);
  wait_from_all(c, rs);
  wait_from_all(c, setup_rs);
  c.wait_all(sends);
  d.word_at.assign(n, 0);
  d.pid_of.assign(n, 0);
  for (int g = 0; g < n; ++g) {
    if (g == me) continue;
    d.word_at[g] = d.in[g].addr;
    d.pid_of[g] = d.in[g].pid;
  }
  for (int g = 0; g < n; ++g) {
    if (g == me) continue;
    for (std::size_t i = 0; i < setup_names.size(); ++i)
      TROUPE_CHECK(d.tuning_in[g][i] == d.tuning_out[i], d.op, ": rank ", c.ranks[g],
                   " has algo_tuning::", setup_names[i], " = ", d.tuning_in[g][i], " but rank ",
                   c.ranks[me], " has ", d.tuning_out[i],
                   " (the tuning must be the same on every rank)");
  }
  // The verdict: addr 1 where not every member is on this host; count: the errno of the first
  // failed copy, kind: the rank it tried.
  direct_msg mine{hello_magic, local ? 0u : 1u, 0, 0, 0, -1};
  for (int j = 1; j < n && local && mine.count == 0; ++j) {
    const int g = (me + j) % n;
    std::uint64_t v = 0;
    int err = try_copy(d.in[g].pid, &v, d.in[g].addr, sizeof v);
    if (err == 0 && v != (hello_magic ^ static_cast<std::uint64_t>(d.in[g].pid))) err = EIO;
    // The write test goes to the scratch word after the state word (state_words).
    if (err == 0) err = try_copy(d.in[g].pid, &v, d.in[g].addr + 8, sizeof v, true);
    if (err != 0)
      mine = direct_msg{hello_magic, 0, static_cast<std::uint64_t>(err), 0, 0, c.ranks[g]};
  }
  // aux: 0 where this rank mapped every peer's segment, else 1 + the errno.
  mine.aux = 1;
  if (local && mine.count == 0 && fd >= 0) {
    const int err = shm_map_peers(c);
    mine.aux = err == 0 ? 0 : 1 + static_cast<std::uint64_t>(err);
  }
  d.out = mine;
  sends.clear();
  recv_from_all(c, d.in, rs);
  send_to_all(c, d.out, sends);
  wait_from_all(c, rs);
  c.wait_all(sends);
  d.in[me] = mine;
  bool shm_all = true;
  for (int g = 0; g < n; ++g) shm_all = shm_all && d.in[g].aux == 0;
  if (!shm_all) d.shm.reset();
  for (int g = 0; g < n; ++g)
    if (d.in[g].addr != 0) return false;
  for (int g = 0; g < n; ++g) {
    if (d.in[g].count == 0) continue;
    if (me == 0 && (c.tune.allreduce_direct || c.tune.pull_direct))
      std::fprintf(stderr,
                   "troupe: %s: direct collectives off, using messages: rank %d cannot access "
                   "rank %d's memory (process_vm_readv/writev: %s)\n",
                   d.comm_name.c_str(), c.ranks[g], d.in[g].kind,
                   errno_text(static_cast<int>(d.in[g].count)).c_str());
    return false;
  }
  return true;
}

// Every rank sends every peer one end message per op (direct_state): "done" (it will not touch
// the peer's buffers again) or "stop" (its op failed: the peer must stop too). Throws when peer
// g's end message (arrived) says "stop".
void throw_if_stopped(op_context& c, direct_state& d, int g) {
  const std::uint32_t code = d.finished[g];
  if (code < 2) return;
  d.stopped_by = code;
  const std::string who = "rank " + std::to_string((code - 2) / 2);
  const std::string by = " (told by rank " + std::to_string(c.ranks[g]) + ")";
  if ((code - 2) % 2 == 1) throw troupe::error(who + " lost: its process is gone" + by);
  throw troupe::error(std::string("direct ") + d.op + ": " + who +
                      " failed its part of the op and stopped it" + by);
}

// Whether peer g is lost or its process is gone (then it reads or writes nothing any more).
bool peer_gone(op_context& c, direct_state& d, int g) {
  std::uint64_t v = 0;
  return !c.t.peer_failure(c.ranks[g]).empty() ||
         try_copy(d.pid_of[g], &v, d.word_at[g], sizeof v) == ESRCH;
}

// Whether peer g left this communicator's direct ops (direct_left): its state word says so.
bool peer_left(direct_state& d, int g) {
  std::uint64_t v = 0;
  return try_copy(d.pid_of[g], &v, d.word_at[g], sizeof v) == 0 &&
         v == (left_magic ^ static_cast<std::uint64_t>(d.pid_of[g]));
}

// After this rank's op failed: tells every peer to stop (unless it already said "done") and waits
// until each peer's end message ("done" or "stop") arrived, the peer is lost, its process is gone,
// or it left the communicator's direct ops (a peer that failed this op before its hello round - at
// the op's start, or in the probe that this rank passed - sends no end message: seen when a rank
// died during the probe), so that no peer reads or writes this rank's buffers after the op returns.
// The wait ignores abort() and the op's deadline (either may be why the op failed) and is bounded
// by the op's timeout (at least 1 s) where it has one, else only by the membership layer declaring
// the peer lost; a peer that neither answers nor dies within that bound is the residual case
// (logged).
void stop_peers(op_context& c, direct_state& d, std::vector<p2p_request>& ends,
                bool sent_done) noexcept {
  using clock = std::chrono::steady_clock;
  const auto until = c.timeout.count() > 0
                         ? clock::now() + std::max(c.timeout, std::chrono::milliseconds{1000})
                         : clock::time_point::max();
  // Relay the "stop" that stopped this rank, else name a lost peer, else this rank.
  d.stop = d.stopped_by != 0 ? d.stopped_by : 2 + 2 * static_cast<std::uint32_t>(c.ranks[c.me]);
  for (int g = 0; g < c.n && d.stopped_by == 0; ++g)
    if (g != c.me && peer_gone(c, d, g)) {
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
      if (peer_gone(c, d, g) || peer_left(d, g)) break;
      if (clock::now() > until) {
        std::fprintf(stderr,
                     "troupe: %s: direct %s failed on rank %d and rank %d neither stopped nor was "
                     "lost within %lld ms: it may still use rank %d's buffers\n",
                     d.comm_name.c_str(), d.op, c.ranks[c.me], c.ranks[g],
                     static_cast<long long>(c.timeout.count()), c.ranks[c.me]);
        break;
      }
    }
  }
}

}  // namespace

bool direct_ready(op_context& c, const char* op, bool enabled, std::size_t bytes,
                  std::size_t min_bytes) {
  if (c.direct == nullptr || c.n < 2) return false;
  direct_state& d = *c.direct;
  d.op = op;
  if (d.m == direct_state::mode::unknown) {
    d.in.assign(c.n, direct_msg{});
    d.outs.assign(c.n, direct_msg{});
    d.finished.assign(c.n, 0);
    bool local = true;
    for (int g = 0; g < c.n; ++g) local = local && (g == c.me || c.t.same_host(c.ranks[g]));
    d.m = probe(c, d, local) ? direct_state::mode::on : direct_state::mode::off;
  }
  return d.m == direct_state::mode::on && enabled && bytes >= min_bytes;
}

void copy_peer(op_context& c, int g, void* local, std::uint64_t remote, std::size_t bytes,
               bool write) {
  const int pid = c.direct->in[g].pid;
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
  throw troupe::error(std::string("direct ") + c.direct->op + ": " +
                      (write ? "writing " : "reading ") + std::to_string(bytes) +
                      " bytes of rank " + std::to_string(w) + " (pid " + std::to_string(pid) +
                      ") at " + where + " failed: " + errno_text(err));
}

void poll_stops(op_context& c, std::vector<p2p_request>& ends, std::vector<char>& seen) {
  for (int j = 1; j < c.n; ++j) {
    const int g = (c.me + j) % c.n;
    if (seen[g] || !c.t.test(ends[g])) continue;
    seen[g] = 1;
    throw_if_stopped(c, *c.direct, g);
  }
}

void direct_round(op_context& c, const std::function<void()>& local,
                  const std::function<void(int)>& check,
                  const std::function<void(std::vector<p2p_request>&)>& body) {
  const int n = c.n, me = c.me;
  direct_state& d = *c.direct;
  // 1. hello, and the receives of the "done"/"stop" messages (they match in posting order).
  std::fill(d.finished.begin(), d.finished.end(), std::uint32_t{0});
  d.stopped_by = 0;
  std::vector<p2p_request> hello_rs(n), finished_rs(n), sends;
  sends.reserve(2 * n);
  recv_from_all(c, d.in, hello_rs);
  recv_from_all(c, d.finished, finished_rs);
  bool sent_done = false;
  try {
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      d.outs[g].magic = hello_magic;
      d.outs[g].pid = getpid();
      sends.push_back(c.isend(g, &d.outs[g], sizeof(direct_msg)));
    }
    local();
    wait_from_all(c, hello_rs);
    for (int g = 0; g < n; ++g) {
      if (g == me) continue;
      TROUPE_CHECK(d.in[g].magic == hello_magic, "direct ", d.op, ": rank ", c.ranks[g],
                   " sent a message that is not a hello");
      check(g);
    }
    body(finished_rs);
    // 2. Done with every peer's buffer; wait until every peer is done with this one.
    send_to_all(c, d.done, sends);
    sent_done = true;
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      c.wait(finished_rs[g]);
      throw_if_stopped(c, d, g);
    }
    c.wait_all(sends);
  } catch (...) {
    stop_peers(c, d, finished_rs, sent_done);
    throw;
  }
}

void direct_left(direct_state& d) {
  if (d.word != nullptr)
    d.word->store(left_magic ^ static_cast<std::uint64_t>(getpid()), std::memory_order_release);
}

}  // namespace troupe::collective::detail
