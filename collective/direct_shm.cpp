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
// "done" round. Nor a hello round through UCX: each rank numbers its staged ops and, before it
// moves a chunk of one, writes a record of it into its segment (number, op code, count, and for
// all_to_allv what it sends and expects from every rank; a ring of 4 records). It reads a peer's
// chunks only after it checked that peer's record of the op against its own, and ends the op only
// when it checked every peer's: a record that differs fails the op naming both ranks (its peers
// fail through the failure word, or finish where their own pairs agree and their chunks all came).
// So no rank is ever more than one staged op ahead of another, and all_to_allv needs no count
// exchange: it takes the staged path at every size where the segments exist (every rank decides
// alike, without the others' counts). (The hello round, one message round trip through UCX and
// the executors, was ~1 us of the ~2.4 us of a 2-rank 64 KiB all_gather; the count exchange as
// much of all_to_allv's.)
//
// Other paths: every collective, on whatever path, first writes its number (each rank counts its
// collectives alike) and signature into one line of its rank's segment (shm_note_op). A staged op
// waiting for a peer's record reads that line too, and every other op's waits read it
// (shm_check_ops, from op_context::check): a peer whose line has this op's number but another
// signature (another op, or an all_gather on the other side of shm_min), or a number past it
// while its staged record never came (a broadcast's root that finished alone), fails the op at
// once on both sides, without the deadline.
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
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "collective/algo.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

// What a staged op sends through channel ch of this rank's segment (read by `reader`, or by every
// peer where -1: all_gather), and what it receives through channel ch of rank g's.
struct shm_out_channel {
  int ch = 0, reader = -1;
  const char* src = nullptr;
  std::size_t bytes = 0, chunks = 0, done = 0;
  std::uint64_t base = 0;
};
struct shm_in_channel {
  int g = 0, ch = 0;
  char* dst = nullptr;
  std::size_t bytes = 0, chunks = 0, done = 0;
  std::uint64_t base = 0;
};

struct shm_segments {
  int n = 0, me = 0, slots = 0;
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
  // Rank g's record of its staged op number q: [q, its collective number, op code, count, what it
  // sends each rank (n words), what it expects from each (n words)], ops_ring records in a ring.
  static constexpr std::uint64_t ops_ring = 4;
  std::size_t record_lines() const { return (4 + 2 * static_cast<std::size_t>(n) + 7) / 8; }
  std::atomic<std::uint64_t>* record(int g, std::uint64_t q) const {
    return line(g, static_cast<std::size_t>(n) * (n + 1) + 1 + (q % ops_ring) * record_lines());
  }
  // Rank g's record of the collective it runs, on any path: [its number, kind, count, root].
  std::atomic<std::uint64_t>* current(int g) const {
    return line(g, static_cast<std::size_t>(n) * (n + 1) + 1 + ops_ring * record_lines());
  }
  static std::size_t ctrl_lines(int n, std::size_t record_lines) {
    return static_cast<std::size_t>(n) * (n + 1) + 1 + ops_ring * record_lines + 1;
  }
  std::uint64_t seq = 0;  // the number of this rank's last staged op
  // The running staged op's channels and which peers' records it checked: kept across ops, so
  // that an op allocates nothing once they have grown.
  std::vector<shm_out_channel> outs;
  std::vector<shm_in_channel> ins;
  std::vector<char> checked;
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
  s->ctrl_bytes = (shm_segments::ctrl_lines(n, s->record_lines()) * 64 + 4095) / 4096 * 4096;
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
  s->me = c.me;
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

// Copies len bytes to dst, with streaming stores where `stream` (an output larger than the caches:
// its lines are not read for ownership first); the caller fences once at the end.
void copy_to(char* dst, const char* src, std::size_t len, bool stream) {
#if defined(__x86_64__)
  if (stream && len >= 4096) {
    const std::size_t head = (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16;
    std::memcpy(dst, src, head);
    std::size_t i = head;
    for (; i + 64 <= len; i += 64) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
      const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
    }
    std::memcpy(dst + i, src + i, len - i);
    return;
  }
#endif
  (void)stream;
  std::memcpy(dst, src, len);
}

// Sets this rank's `failed` word to world rank w + 1 unless it names a rank already.
void mark_failed(const op_context& c, std::uint64_t w) {
  std::uint64_t none = 0;
  c.direct->shm->failed(c.me)->compare_exchange_strong(none, w + 1, std::memory_order_acq_rel);
}

// What this rank's current staged op is: its op code and count (all_to_allv: 0, and its counts).
struct op_record {
  std::uint64_t code = 0, count = 0;
  const std::vector<std::size_t>* sends = nullptr;
  const std::vector<std::size_t>* recvs = nullptr;
};
std::uint64_t code(std::int32_t kind) {
  return static_cast<std::uint32_t>(kind);
}

// Writes this rank's record of its staged op s.seq (a seqlock: readers see the number last).
void write_record(const shm_segments& s, int me, std::uint64_t op_no, const op_record& mine) {
  std::atomic<std::uint64_t>* r = s.record(me, s.seq);
  r[0].store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  r[1].store(op_no, std::memory_order_relaxed);
  r[2].store(mine.code, std::memory_order_relaxed);
  r[3].store(mine.count, std::memory_order_relaxed);
  if (mine.sends != nullptr)
    for (int g = 0; g < s.n; ++g) {
      r[4 + g].store((*mine.sends)[g], std::memory_order_relaxed);
      r[4 + s.n + g].store((*mine.recvs)[g], std::memory_order_relaxed);
    }
  r[0].store(s.seq, std::memory_order_release);
}

// A peer's record of the collective it runs (shm_segments::current), read whole (a seqlock);
// number 0 where there is none yet or it is being rewritten (the peer moves on).
struct op_seen {
  std::uint64_t no = 0;
  op_signature sig;
};
op_seen read_current(const shm_segments& s, int g) {
  const std::atomic<std::uint64_t>* r = s.current(g);
  const std::uint64_t no = r[0].load(std::memory_order_acquire);
  if (no == 0) return {};
  op_seen o;
  o.sig.kind = static_cast<std::int32_t>(r[1].load(std::memory_order_relaxed));
  o.sig.count = r[2].load(std::memory_order_relaxed);
  o.sig.root = static_cast<std::int32_t>(r[3].load(std::memory_order_relaxed));
  std::atomic_thread_fence(std::memory_order_acquire);
  if (r[0].load(std::memory_order_relaxed) != no) return {};
  o.no = no;
  return o;
}

bool same_op(const op_signature& a, const op_signature& b) {
  return a.kind == b.kind && a.count == b.count && a.root == b.root;
}

// "all_gather of f32 x 1024", "allreduce (sum) of f32 x 16", "broadcast of f32 x 8 from group
// rank 1", "all_to_allv of f32", "barrier".
std::string op_text(const op_signature& o) {
  const auto k = static_cast<op_kind>(o.kind >> 16 & 0xff);
  std::string t = op_kind_name(k);
  if (k == op_kind::barrier) return t;
  if (k == op_kind::allreduce || k == op_kind::reduce_scatter)
    t += std::string(" (") + reduce_op_name(static_cast<reduce_op>(o.kind & 0xff)) + ")";
  t += " of " + std::string(dtype_name(static_cast<dtype>(o.kind >> 8 & 0xff)));
  if (k != op_kind::all_to_allv) t += " x " + std::to_string(o.count);
  if (k == op_kind::broadcast) t += " from group rank " + std::to_string(o.root);
  return t;
}

// Rank g's record says it runs another op as this rank's collective d.op_no: fails this rank's
// op (and tells its peers through the failure word) naming both ranks and ops.
[[noreturn]] void throw_other_op(const op_context& c, int g, const op_signature& theirs) {
  const direct_state& d = *c.direct;
  mark_failed(c, static_cast<std::uint64_t>(c.ranks[c.me]));
  throw troupe::error("rank " + std::to_string(c.ranks[g]) + " issued " + op_text(theirs) +
                      " as collective #" + std::to_string(d.op_no) +
                      " of this communicator, but rank " + std::to_string(c.ranks[c.me]) +
                      " issued " + op_text(d.sig));
}

// Whether rank g's record of this rank's staged op s.seq is there; throws where it is and differs
// from this rank's (another op or count; all_to_allv counts that differ within the pair), or
// where g's ring already holds a later op (out of step). Where it is not there yet, g's record of
// its running op says whether g issued another op as this one, or went past it (a broadcast's
// root may finish without its peers).
bool check_record(op_context& c, const shm_segments& s, int g, const op_record& mine) {
  const std::atomic<std::uint64_t>* r = s.record(g, s.seq);
  std::uint64_t q = r[0].load(std::memory_order_acquire);
  const direct_state& d = *c.direct;
  if (q < s.seq) {  // not there yet (or being written): the common case, no strings
    const op_seen o = read_current(s, g);
    if (o.no < d.op_no) return false;
    if (o.no == d.op_no) {
      if (!same_op(o.sig, d.sig)) throw_other_op(c, g, o.sig);
      return false;
    }
    // g is past this op: where it ran it, its record of it was written before it moved on.
    q = r[0].load(std::memory_order_acquire);
    if (q < s.seq)
      throw troupe::error("staged " + std::string(d.op) + ": rank " + std::to_string(c.ranks[g]) +
                          " went past collective #" + std::to_string(d.op_no) +
                          " without taking part in rank " + std::to_string(c.ranks[c.me]) + "'s " +
                          op_text(d.sig) + " (it runs collective #" + std::to_string(o.no) + ", " +
                          op_text(o.sig) + ")");
  }
  const std::string who = std::to_string(c.ranks[g]), self = std::to_string(c.ranks[c.me]);
  if (q > s.seq)
    throw troupe::error("staged " + std::string(c.direct->op) + ": rank " + who +
                        " is out of step (its record of staged op #" + std::to_string(s.seq) +
                        " reads #" + std::to_string(q) + ")");
  const std::uint64_t no = r[1].load(std::memory_order_relaxed);
  if (no != d.op_no)
    throw troupe::error("staged " + std::string(d.op) + ": rank " + who + " ran its staged op #" +
                        std::to_string(s.seq) + " as collective #" + std::to_string(no) +
                        ", rank " + self + " as collective #" + std::to_string(d.op_no) +
                        " (they issued different sequences of ops)");
  const std::uint64_t op = r[2].load(std::memory_order_relaxed);
  const std::uint64_t count = r[3].load(std::memory_order_relaxed);
  if (op != mine.code || count != mine.count)
    throw troupe::error("staged " + std::string(c.direct->op) + ": rank " + who +
                        " issued another op or count (" + std::to_string(count) +
                        " elements, op code " + std::to_string(static_cast<std::int32_t>(op)) +
                        ") than rank " + self + " (" + std::to_string(mine.count) +
                        " elements, op code " +
                        std::to_string(static_cast<std::int32_t>(mine.code)) + ")");
  if (mine.sends == nullptr) return true;
  // The same texts as the message path's count check (algo_small.cpp).
  const std::uint64_t sends = r[4 + c.me].load(std::memory_order_relaxed);
  const std::uint64_t expects = r[4 + s.n + c.me].load(std::memory_order_relaxed);
  if (sends != (*mine.recvs)[g])
    throw troupe::error("all_to_allv: rank " + who + " sends " + std::to_string(sends) +
                        " elements to rank " + self + ", which expects " +
                        std::to_string((*mine.recvs)[g]) + " from it");
  if (expects != (*mine.sends)[g])
    throw troupe::error("all_to_allv: rank " + self + " sends " + std::to_string((*mine.sends)[g]) +
                        " elements to rank " + who + ", which expects " + std::to_string(expects) +
                        " from it");
  return true;
}

// Throws when a peer failed its part (c.check: shm_check_ops) or is lost (c.check: the
// transport; here: its process is gone).
void check_peers(op_context& c, const shm_segments& s) {
  c.check();
  for (int g = 0; g < c.n; ++g) {
    if (g == c.me) continue;
    if (kill(s.pids[g], 0) != 0 && errno == ESRCH)
      throw troupe::error("rank " + std::to_string(c.ranks[g]) + " lost: its process (pid " +
                          std::to_string(s.pids[g]) + ") is gone");
  }
}

// A rank that can move nothing: spins briefly, then yields the CPU (ranks may share cores), and
// every 256 turns checks its deadline and its peers. On one allowed CPU (yield_poll), where a
// thread sharing the CPU may need it, it yields on every 8th of its first 64 idle turns and on
// every turn after: a sched_yield with nobody else to run is a syscall, and one on every turn kept
// a 2-rank staged all_to_allv of 1 KiB at 0.93 us (0.63 with this; docs/performance.md), while a
// thread sharing the CPU waits at most 7 polls more (4 ranks on 2 CPUs: unchanged within 3%).
void idle_turn(op_context& c, const shm_segments& s, unsigned& idle) {
  ++idle;
  if (idle < 64 && (!c.yield_poll || (idle & 7) != 0))
    cpu_relax();
  else
    sched_yield();
  if ((idle & 255) == 0) check_peers(c, s);
}

// The own block, copied a chunk at a time whenever no chunk can move between ranks (so that the
// copy fills the waits instead of adding to them).
struct self_copy {
  const char* src = nullptr;
  char* dst = nullptr;
  std::size_t bytes = 0, done = 0;
};

// Moves every chunk of `outs`, `ins` and `own` of the staged op `mine`.
void pump(op_context& c, self_copy& own, const op_record& mine) {
  shm_segments& s = *c.direct->shm;
  const int me = c.me;
  const std::size_t S = s.slot_bytes;
  const auto K = static_cast<std::uint64_t>(s.slots);
  // This op's record, before any of its chunks; a peer's chunks are read only after its record
  // was checked, and the op ends only when every peer's was.
  ++s.seq;
  write_record(s, me, c.direct->op_no, mine);
  std::vector<shm_out_channel>& outs = s.outs;
  std::vector<shm_in_channel>& ins = s.ins;
  std::vector<char>& checked = s.checked;
  checked.assign(c.n, 0);
  checked[me] = 1;
  int unchecked = c.n - 1;
  for (auto& o : outs) {
    o.chunks = (o.bytes + S - 1) / S;
    o.base = s.produced(me, o.ch)->load(std::memory_order_relaxed);
  }
  for (auto& i : ins) {
    i.chunks = (i.bytes + S - 1) / S;
    i.base = s.consumed(i.g, i.ch, me)->load(std::memory_order_relaxed);
  }
  std::size_t left = 0, out_bytes = own.bytes;
  for (auto& i : ins) out_bytes += i.bytes;
  const bool stream = out_bytes >= c.tune.shm_stream_min;
  for (auto& o : outs) left += o.chunks;
  for (auto& i : ins) left += i.chunks;
  unsigned idle = 0, turns = 0;
  while (left > 0 || unchecked > 0) {
    bool moved = false;
    for (int g = 0; g < c.n && unchecked > 0; ++g)
      if (checked[g] == 0 && check_record(c, s, g, mine)) {
        checked[g] = 1;
        --unchecked;
        moved = true;
      }
    for (auto& o : outs) {
      if (o.done == o.chunks) continue;
      const std::uint64_t k = o.base + o.done;
      bool room = true;
      if (o.reader >= 0)
        room = k - s.consumed(me, o.ch, o.reader)->load(std::memory_order_acquire) < K;
      else
        for (int r = 0; r < c.n; ++r)
          room =
              room && (r == me || k - s.consumed(me, o.ch, r)->load(std::memory_order_acquire) < K);
      if (!room) continue;
      const std::size_t off = o.done * S, len = std::min(S, o.bytes - off);
      std::memcpy(s.slot(me, o.ch, k), o.src + off, len);
      s.produced(me, o.ch)->store(k + 1, std::memory_order_release);
      ++o.done;
      --left;
      moved = true;
    }
    for (auto& i : ins) {
      if (i.done == i.chunks || checked[i.g] == 0) continue;
      const std::uint64_t k = i.base + i.done;
      if (s.produced(i.g, i.ch)->load(std::memory_order_acquire) <= k) continue;
      const std::size_t off = i.done * S, len = std::min(S, i.bytes - off);
      copy_to(i.dst + off, s.slot(i.g, i.ch, k), len, stream);
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
      if (stream)
        copy_to(own.dst + own.done, own.src + own.done, len, true);
      else
        std::memmove(own.dst + own.done, own.src + own.done, len);
      own.done += len;
      continue;
    }
    idle_turn(c, s, idle);
  }
  if (own.done < own.bytes && stream)
    copy_to(own.dst + own.done, own.src + own.done, own.bytes - own.done, true);
  else if (own.done < own.bytes)
    std::memmove(own.dst + own.done, own.src + own.done, own.bytes - own.done);
#if defined(__x86_64__)
  if (stream) _mm_sfence();
#endif
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

}  // namespace

void shm_note_op(direct_state& d) {
  if (d.m != direct_state::mode::on || !d.shm) return;
  const shm_segments& s = *d.shm;
  std::atomic<std::uint64_t>* r = s.current(s.me);
  r[0].store(0, std::memory_order_relaxed);
  std::atomic_thread_fence(std::memory_order_release);
  r[1].store(static_cast<std::uint32_t>(d.sig.kind), std::memory_order_relaxed);
  r[2].store(d.sig.count, std::memory_order_relaxed);
  r[3].store(static_cast<std::uint32_t>(d.sig.root), std::memory_order_relaxed);
  r[0].store(d.op_no, std::memory_order_release);
}

void shm_check_ops(const op_context& c) {
  const direct_state* d = c.direct;
  if (d == nullptr || d->m != direct_state::mode::on || !d->shm) return;
  const shm_segments& s = *d->shm;
  for (int g = 0; g < c.n; ++g) {
    if (g == c.me) continue;
    const op_seen o = read_current(s, g);
    if (o.no == d->op_no && !same_op(o.sig, d->sig)) throw_other_op(c, g, o.sig);
  }
  for (int g = 0; g < c.n; ++g) {
    if (g == c.me) continue;
    const std::uint64_t f = s.failed(g)->load(std::memory_order_acquire);
    if (f == 0) continue;
    // A peer that failed because a rank died: name the dead rank, which this rank's transport
    // may not have noticed yet (every member is a process of this host).
    for (int h = 0; h < c.n; ++h)
      if (h != c.me && s.pids[h] > 0 && kill(s.pids[h], 0) != 0 && errno == ESRCH)
        throw troupe::error("rank " + std::to_string(c.ranks[h]) + " lost: its process (pid " +
                            std::to_string(s.pids[h]) + ") is gone");
    mark_failed(c, f - 1);  // relayed, so that every rank names the one that failed
    const auto k = static_cast<op_kind>(d->sig.kind >> 16 & 0xff);
    throw troupe::error(std::string(op_kind_name(k)) + ": rank " + std::to_string(f - 1) +
                        " failed its part of the op and stopped it" +
                        (f - 1 != static_cast<std::uint64_t>(c.ranks[g])
                             ? " (told by rank " + std::to_string(c.ranks[g]) + ")"
                             : std::string()));
  }
}

void all_gather_shm(op_context& c, const void* in, void* out, std::size_t count, dtype t) {
  const int n = c.n, me = c.me;
  const std::size_t bytes = count * dtype_size(t);
  const std::int32_t kind = direct_kind(op_kind::all_gather, t, reduce_op::sum);
  char* o = static_cast<char*>(out);
  marking_failure(c, [&] {
    shm_segments& s = *c.direct->shm;
    s.outs.assign(1, shm_out_channel{me, -1, static_cast<const char*>(in), bytes});
    s.ins.clear();
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      s.ins.push_back(shm_in_channel{g, g, o + g * bytes, bytes});
    }
    self_copy own{static_cast<const char*>(in), o + me * bytes, o + me * bytes == in ? 0 : bytes};
    pump(c, own, op_record{code(kind), count});
  });
}

void all_to_allv_shm(op_context& c, op_kind k, const void* in,
                     const std::vector<std::size_t>& send_counts, void* out,
                     const std::vector<std::size_t>& recv_counts, dtype t) {
  const int n = c.n, me = c.me;
  const std::size_t es = dtype_size(t);
  const std::int32_t kind = direct_kind(k, t, reduce_op::sum);
  const std::vector<std::size_t> soff = offsets_of(send_counts), roff = offsets_of(recv_counts);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  marking_failure(c, [&] {
    shm_segments& s = *c.direct->shm;
    s.outs.clear();
    s.ins.clear();
    for (int j = 1; j < n; ++j) {
      const int g = (me + j) % n;
      s.outs.push_back(shm_out_channel{g, g, src + soff[g] * es, send_counts[g] * es});
      s.ins.push_back(shm_in_channel{g, me, dst + roff[g] * es, recv_counts[g] * es});
    }
    self_copy own{src + soff[me] * es, dst + roff[me] * es, send_counts[me] * es};
    const bool varied = k == op_kind::all_to_allv;
    pump(c, own,
         op_record{code(kind), varied ? 0 : send_counts[me], varied ? &send_counts : nullptr,
                   varied ? &recv_counts : nullptr});
  });
}

}  // namespace troupe::collective::detail
