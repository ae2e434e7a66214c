// The staged copy ops between processes of one host: all_gather and all_to_all(v) through
// shared-memory slot rings.
//
// Why: process_vm_readv pins every page it copies (~350 ns per 4 KiB page in this VM, so one copy
// runs at ~10 GB/s even when the data is in cache), while a plain memcpy of cached data runs at
// 20-50 GB/s. OpenMPI over UCX's shared memory copies twice (into a FIFO, out of it) and beat the
// pull ops 1.2-2x on a quieter machine. So here each rank copies its blocks, chunk by chunk, into
// slots of its own segment, and each peer copies them out of there into its output while they are
// in cache.
//
// Each rank's segment (a memfd, created by the probe; every peer maps it through
// /proc/<pid>/fd/<fd>, which needs the same permission as process_vm_readv) holds one channel per
// group rank: a ring of shm_slots slots of shm_slot_bytes, a `produced` counter written by the
// owner and one `consumed` counter per reader, each on its own cache line, plus a `failed` word.
// all_to_all(v) sends rank g its block through channel g of the sender's segment; all_gather
// sends its one block through channel `me` to every peer (one staging copy for all readers; a
// slot is reused once every reader consumed it). The counters only grow, across ops: every rank
// issues the same ops with the same counts (checked before), so the chunks of an op are the next
// ones on each channel on both sides, and a rank may start the next op while a peer still reads
// the last one's chunks. A rank never writes into another rank's user buffers and reads only its
// own inputs, so it may return as soon as it produced and consumed all of its chunks: there is no
// "done" round.
//
// Waiting: a rank that can neither produce (every reader behind) nor consume (nothing new) spins a
// little and then yields the CPU (ranks may share cores); every ~256 idle turns it checks its
// deadline and abort, and whether a peer failed (its `failed` word, set before it throws out of
// an op) or was lost (the transport, or its process gone), and fails naming that rank.
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

#include <fcntl.h>

#include "collective/algo.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

struct shm_segments {
  int n = 0, slots = 0;
  std::size_t slot_bytes = 0, ctrl_bytes = 0, bytes = 0;
  int fd = -1;
  std::vector<char*> base;  // by group rank (this rank's own segment at me)
  std::vector<int> pids;

  ~shm_segments() {
    for (char* b : base)
      if (b != nullptr) munmap(b, bytes);
    if (fd >= 0) close(fd);
  }
  std::atomic<std::uint64_t>* line(int g, std::size_t i) const {
    return reinterpret_cast<std::atomic<std::uint64_t>*>(base[g] + i * 64);
  }
  // Channel ch of rank g's segment: its produced counter, reader r's consumed counter, its slots.
  std::atomic<std::uint64_t>* produced(int g, int ch) const {
    return line(g, static_cast<std::size_t>(ch) * (n + 1));
  }
  std::atomic<std::uint64_t>* consumed(int g, int ch, int r) const {
    return line(g, static_cast<std::size_t>(ch) * (n + 1) + 1 + r);
  }
  std::atomic<std::uint64_t>* failed(int g) const {
    return line(g, static_cast<std::size_t>(n) * (n + 1));
  }
  char* slot(int g, int ch, std::uint64_t k) const {
    return base[g] + ctrl_bytes +
           (static_cast<std::size_t>(ch) * slots + static_cast<std::size_t>(k % slots)) *
               slot_bytes;
  }
};

int shm_create(direct_state& d, int n, const algo_tuning& tune) {
  auto s = std::make_shared<shm_segments>();
  s->n = n;
  s->slots = std::max(tune.shm_slots, 1);
  s->slot_bytes = (tune.shm_slot_bytes + 63) / 64 * 64;
  s->ctrl_bytes = ((static_cast<std::size_t>(n) * (n + 1) + 1) * 64 + 4095) / 4096 * 4096;
  s->bytes = s->ctrl_bytes + static_cast<std::size_t>(n) * s->slots * s->slot_bytes;
  s->fd = memfd_create("troupe-collective", MFD_CLOEXEC);
  if (s->fd < 0) return -1;
  if (ftruncate(s->fd, static_cast<off_t>(s->bytes)) != 0) return -1;
  s->base.assign(n, nullptr);
  s->pids.assign(n, 0);
  d.shm = std::move(s);
  return d.shm->fd;
}

int shm_map_peers(op_context& c) {
  shm_segments* s = c.direct->shm.get();
  if (s == nullptr) return EINVAL;
  for (int g = 0; g < c.n; ++g) {
    const direct_msg& h = c.direct->in[g];
    int fd = s->fd;
    if (g != c.me) {
      if (h.aux == ~std::uint64_t{0}) return ENOENT;
      const std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.aux);
      fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
      if (fd < 0) return errno;
      s->pids[g] = h.pid;
    }
    void* p = mmap(nullptr, s->bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
    const int err = errno;
    if (g != c.me) close(fd);
    if (p == MAP_FAILED) return err;
    s->base[g] = static_cast<char*>(p);
  }
  return 0;
}

bool shm_ready(op_context& c, std::size_t bytes) {
  return c.direct != nullptr && c.direct->m == direct_state::mode::on && c.direct->shm &&
         c.tune.shm && bytes >= c.tune.shm_min;
}

namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

struct out_channel {
  int ch = 0;
  std::vector<int> readers;
  const char* src = nullptr;
  std::size_t bytes = 0, chunks = 0, done = 0;
  std::uint64_t base = 0;
};
struct in_channel {
  int g = 0, ch = 0;
  char* dst = nullptr;
  std::size_t bytes = 0, chunks = 0, done = 0;
  std::uint64_t base = 0;
};

// Sets this rank's `failed` word to world rank w + 1 unless it names a rank already.
void mark_failed(op_context& c, std::uint64_t w) {
  std::uint64_t none = 0;
  c.direct->shm->failed(c.me)->compare_exchange_strong(none, w + 1, std::memory_order_acq_rel);
}

// Throws when a peer failed its part (its `failed` word, which names the rank whose failure
// stopped the op; this rank relays it) or is lost.
void check_peers(op_context& c, const shm_segments& s) {
  c.check();
  for (int g = 0; g < c.n; ++g) {
    if (g == c.me) continue;
    const std::uint64_t f = s.failed(g)->load(std::memory_order_acquire);
    if (f != 0) {
      mark_failed(c, f - 1);
      throw troupe::error(std::string("staged ") + c.direct->op + ": rank " +
                          std::to_string(f - 1) + " failed its part of the op and stopped it" +
                          (f - 1 != static_cast<std::uint64_t>(c.ranks[g])
                               ? " (told by rank " + std::to_string(c.ranks[g]) + ")"
                               : std::string()));
    }
    const std::string lost = c.t.peer_failure(c.ranks[g]);
    if (!lost.empty()) throw troupe::error("rank " + std::to_string(c.ranks[g]) + " lost: " + lost);
    if (kill(s.pids[g], 0) != 0 && errno == ESRCH)
      throw troupe::error("rank " + std::to_string(c.ranks[g]) + " lost: its process (pid " +
                          std::to_string(s.pids[g]) + ") is gone");
  }
}

// The own block, copied a chunk at a time whenever no chunk can move between ranks (so that the
// copy fills the waits instead of adding to them).
struct self_copy {
  const char* src = nullptr;
  char* dst = nullptr;
  std::size_t bytes = 0, done = 0;
};

// Moves every chunk of `outs`, `ins` and `own`.
void pump(op_context& c, std::vector<out_channel>& outs, std::vector<in_channel>& ins,
          self_copy& own) {
  shm_segments& s = *c.direct->shm;
  const int me = c.me;
  const std::size_t S = s.slot_bytes;
  const auto K = static_cast<std::uint64_t>(s.slots);
  for (auto& o : outs) {
    o.chunks = (o.bytes + S - 1) / S;
    o.base = s.produced(me, o.ch)->load(std::memory_order_relaxed);
  }
  for (auto& i : ins) {
    i.chunks = (i.bytes + S - 1) / S;
    i.base = s.consumed(i.g, i.ch, me)->load(std::memory_order_relaxed);
  }
  std::size_t left = 0;
  for (auto& o : outs) left += o.chunks;
  for (auto& i : ins) left += i.chunks;
  unsigned idle = 0, turns = 0;
  while (left > 0) {
    bool moved = false;
    for (auto& o : outs) {
      if (o.done == o.chunks) continue;
      const std::uint64_t k = o.base + o.done;
      bool room = true;
      for (int r : o.readers)
        room = room && k - s.consumed(me, o.ch, r)->load(std::memory_order_acquire) < K;
      if (!room) continue;
      const std::size_t off = o.done * S, len = std::min(S, o.bytes - off);
      std::memcpy(s.slot(me, o.ch, k), o.src + off, len);
      s.produced(me, o.ch)->store(k + 1, std::memory_order_release);
      ++o.done;
      --left;
      moved = true;
    }
    for (auto& i : ins) {
      if (i.done == i.chunks) continue;
      const std::uint64_t k = i.base + i.done;
      if (s.produced(i.g, i.ch)->load(std::memory_order_acquire) <= k) continue;
      const std::size_t off = i.done * S, len = std::min(S, i.bytes - off);
      std::memcpy(i.dst + off, s.slot(i.g, i.ch, k), len);
      s.consumed(i.g, i.ch, me)->store(k + 1, std::memory_order_release);
      ++i.done;
      --left;
      moved = true;
    }
    if (moved) {
      idle = 0;
      if ((++turns & 15) == 0) c.check();  // the deadline and abort while data flows
      continue;
    }
    if (own.done < own.bytes) {
      const std::size_t len = std::min(S, own.bytes - own.done);
      std::memmove(own.dst + own.done, own.src + own.done, len);
      own.done += len;
      continue;
    }
    ++idle;
    if (idle < 64 && !c.yield_poll)
      cpu_relax();
    else
      sched_yield();
    if ((idle & 255) == 0) check_peers(c, s);
  }
  if (own.done < own.bytes)
    std::memmove(own.dst + own.done, own.src + own.done, own.bytes - own.done);
}

// Runs f; where it throws, this rank's `failed` word tells its peers before the error leaves.
template <typename F>
void marking_failure(op_context& c, F&& f) {
  try {
    f();
  } catch (...) {
    mark_failed(c, static_cast<std::uint64_t>(c.ranks[c.me]));
    throw;
  }
}

// The hello round of the staged ops: every rank sends every peer what it issues (op, dtype, count
// or the pair's counts) and checks theirs (check(g) throws naming the ranks).
void hello_round(op_context& c, const std::function<void(int)>& check) {
  direct_state& d = *c.direct;
  const int n = c.n, me = c.me;
  std::vector<p2p_request> rs(n), sends;
  for (int j = 1; j < n; ++j) {
    const int g = (me + j) % n;
    rs[g] = c.irecv(g, &d.in[g], sizeof(direct_msg));
  }
  for (int j = 1; j < n; ++j) {
    const int g = (me + j) % n;
    d.outs[g].pid = getpid();
    sends.push_back(c.isend(g, &d.outs[g], sizeof(direct_msg)));
  }
  for (int j = 1; j < n; ++j) c.wait(rs[(me + j) % n]);
  c.wait_all(sends);
  for (int g = 0; g < n; ++g)
    if (g != me) check(g);
}

}  // namespace

void all_gather_shm(op_context& c, const void* in, void* out, std::size_t count, dtype t) {
  direct_state& d = *c.direct;
  const int n = c.n, me = c.me;
  const std::size_t bytes = count * dtype_size(t);
  const std::int32_t kind = direct_kind(op_kind::all_gather, t, reduce_op::sum);
  for (direct_msg& m : d.outs) m = direct_msg{0, 0, count, 0, 0, kind};
  char* o = static_cast<char*>(out);
  marking_failure(c, [&] {
    hello_round(c, [&](int g) {
      TROUPE_CHECK(d.in[g].kind == kind && d.in[g].count == count, "staged all_gather: rank ",
                   c.ranks[g], " issued another op or count (", d.in[g].count,
                   " elements, op code ", d.in[g].kind, ") than rank ", c.ranks[me], " (", count,
                   " elements, op code ", kind, ")");
    });
    std::vector<out_channel> outs(1);
    outs[0].ch = me;
    outs[0].src = static_cast<const char*>(in);
    outs[0].bytes = bytes;
    std::vector<in_channel> ins;
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      outs[0].readers.push_back(g);
      ins.push_back(in_channel{g, g, o + g * bytes, bytes});
    }
    self_copy own{static_cast<const char*>(in), o + me * bytes, o + me * bytes == in ? 0 : bytes};
    pump(c, outs, ins, own);
  });
}

void all_to_allv_shm(op_context& c, op_kind k, const void* in,
                     const std::vector<std::size_t>& send_counts, void* out,
                     const std::vector<std::size_t>& recv_counts, dtype t,
                     const std::string* mismatch) {
  direct_state& d = *c.direct;
  const int n = c.n, me = c.me;
  const std::size_t es = dtype_size(t);
  const std::int32_t kind = direct_kind(k, t, reduce_op::sum);
  const std::vector<std::size_t> soff = offsets_of(send_counts), roff = offsets_of(recv_counts);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  marking_failure(c, [&] {
    if (mismatch != nullptr && !mismatch->empty()) throw troupe::error(*mismatch);
    if (mismatch == nullptr) {
      for (int g = 0; g < n; ++g) d.outs[g] = direct_msg{0, 0, send_counts[g], 0, 0, kind};
      hello_round(c, [&](int g) {
        TROUPE_CHECK(d.in[g].kind == kind && d.in[g].count == recv_counts[g], "staged ",
                     op_kind_name(k), ": rank ", c.ranks[g], " issued another op or count (",
                     d.in[g].count, " elements, op code ", d.in[g].kind, ") than rank ",
                     c.ranks[me], " (", recv_counts[g], " elements, op code ", kind, ")");
      });
    }
    std::vector<out_channel> outs;
    std::vector<in_channel> ins;
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      out_channel o;
      o.ch = g;
      o.readers = {g};
      o.src = src + soff[g] * es;
      o.bytes = send_counts[g] * es;
      outs.push_back(std::move(o));
      ins.push_back(in_channel{g, me, dst + roff[g] * es, recv_counts[g] * es});
    }
    self_copy own{src + soff[me] * es, dst + roff[me] * es, send_counts[me] * es};
    pump(c, outs, ins, own);
  });
}

}  // namespace troupe::collective::detail
