// The collective algorithms over point-to-point messages (internal to p2p_communicator).
//
// Each algorithm is a plain function of an op_context: the transport, the group, the op's tag and
// the helpers that wait on requests while watching for abort, a lost group member or the op's
// deadline. Choices (recursive doubling vs ring, tree vs chain) follow algo_tuning.
//
// 16-bit reductions keep partial results in f32: recursive doubling exchanges the widened f32
// vector, the ring sends f32 partial sums during reduce-scatter (so an allreduce of bf16 moves 1.5x
// the bytes of a bf16 ring, not 2x) and rounds once when a block is final. Every rank ends with
// bitwise the same result: each block is reduced by one rank, and recursive doubling combines
// (lower rank, higher rank) in that order on both partners.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collective/communicator.hpp"
#include "collective/p2p_communicator.hpp"
#include "collective/transport.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

// Grow-only scratch buffers reused across ops (one op of a communicator runs at a time).
class scratch_pool {
 public:
  void* get(int slot, std::size_t bytes);

 private:
  struct buf {
    std::unique_ptr<std::byte[]> p;
    std::size_t size = 0;
  };
  buf bufs_[4];
};

// The messages of the direct path (direct_sync.cpp): a hello (pid, the address this peer is to
// read or write, count, what the op is in `kind`, and `aux`: what all_to_allv expects from this
// peer), the probe's first message (tuning in `count`, `kind` and `aux`) or its verdict (errno in
// `count`, the rank read in `kind`).
struct direct_msg {
  std::uint64_t magic = 0;
  std::uint64_t addr = 0;
  std::uint64_t count = 0;
  std::uint64_t aux = 0;
  std::int32_t pid = 0;
  std::int32_t kind = 0;
};

// What a communicator knows about reading its peers' memory directly (direct_sync.cpp). Decided
// once, by the communicator's first op that may take the direct path (allreduce, reduce_scatter,
// all_gather, all_to_all, all_to_allv), the same way on every rank. The message buffers live
// here, not on the stack of the op: after a failed op a live peer's message may still land in
// them.
// What a collective is, as each rank records it for its peers (direct_shm.cpp): its kind (op, dtype
// and reduce op, as direct_kind), its count (0 for all_to_allv, whose totals differ by rank) and
// broadcast's root (else 0).
struct op_signature {
  std::int32_t kind = 0;
  std::uint64_t count = 0;
  std::int32_t root = 0;
};

struct direct_state {
  enum class mode { unknown, on, off };
  mode m = mode::unknown;
  // This rank's state word, which peers read directly: magic ^ pid from the probe on (the probe
  // reads it), left_magic ^ pid once this communicator failed an op (direct_left). Never freed
  // (direct_sync.cpp), so a peer may still read it after this communicator is gone.
  std::atomic<std::uint64_t>* word = nullptr;
  std::vector<std::uint64_t> word_at;  // each peer's state word (the address in its process)
  std::vector<int> pid_of;             // each peer's pid, both from the probe, by group rank
  std::string comm_name;               // for the one log line when the probe fails
  const char* op = "";  // the running op's name, for error texts ("direct all_gather: ...")
  // The running collective: its number (every collective this communicator ran, counted alike on
  // every rank) and what it is; recorded in the segments where they exist (shm_note_op).
  std::uint64_t op_no = 0;
  op_signature sig;
  direct_msg out;
  std::vector<direct_msg> outs;  // the hello to each peer, by group rank
  std::vector<direct_msg> in;    // by group rank
  // The probe's first round: each rank's direct tuning (direct_sync.cpp), by group rank.
  std::vector<std::array<std::uint64_t, 8>> tuning_in;
  std::array<std::uint64_t, 8> tuning_out{};
  // The shared-memory segments of the staged copy ops (direct_shm.cpp): this rank's, created by
  // the probe, and every peer's, mapped by it; null where the probe could not map them all.
  std::shared_ptr<struct shm_segments> shm;
  // The end message of each peer: "done" (1) or "stop" (2 + 2 * the world rank whose failure
  // stopped the op, + 1 where that rank was lost), and this rank's (algo_direct.cpp).
  std::vector<std::uint32_t> finished;
  std::uint32_t done = 1, stop = 2;
  std::uint32_t stopped_by = 0;  // the first "stop" this op received; 0: none
};

// What an op past its deadline knew: thrown by op_context's waits, turned into the op's error text
// (with the flight record and how long it waited) by the communicator, which then aborts.
struct deadline_error : troupe::error {
  using troupe::error::error;
};

struct op_context {
  transport& t;
  const std::vector<int>& ranks;  // group rank -> world rank
  int me = 0;                     // group rank
  int n = 1;
  std::uint64_t tag = 0;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::chrono::milliseconds timeout{0};
  const std::atomic<bool>* cancelled = nullptr;  // abort() of the communicator
  const algo_tuning& tune;
  scratch_pool* scratch = nullptr;
  // Poll with sched_yield() before blocking in the transport: set when this process may run on
  // one CPU only, where a peer or helper thread sharing the CPU needs it to get anything done.
  bool yield_poll = false;
  direct_state* direct = nullptr;  // the communicator's; null: no direct path
  // By group rank: 1 once a message of this op from that rank arrived (the communicator's
  // buffer, cleared per op; null: not tracked). Says, at a deadline, who has taken part so far.
  std::vector<std::uint8_t>* heard = nullptr;
  // A collective (not send/recv): check() also compares the peers' records of their ops
  // (shm_check_ops).
  bool collective = false;

  p2p_request isend(int to, const void* data, std::size_t bytes) {
    return t.isend(ranks[to], tag, data, bytes);
  }
  p2p_request irecv(int from, void* data, std::size_t bytes) {
    return t.irecv(ranks[from], tag, data, bytes);
  }
  // Waits for r; throws the transport's error, or on abort, a lost group member or the deadline
  // (deadline_error, naming the rank r waits for).
  void wait(p2p_request& r);
  // At the deadline, the deadline_error names every rank whose request of rs is unfinished.
  void wait_all(std::vector<p2p_request>& rs);
  // Throws if the op should stop (abort, lost member, deadline; in a collective, a peer that
  // issued another op as this one or failed its part: shm_check_ops).
  void check() const;
  // Notes a finished receive in `heard`.
  void note_done(const p2p_request& r);
  // "rank 3 (its message of 4096 bytes has not arrived)" for an unfinished request.
  std::string waiting_for(const p2p_request& r) const;
};

// Where each block starts in a buffer of blocks of `counts` elements, and (last) the total.
inline std::vector<std::size_t> offsets_of(const std::vector<std::size_t>& counts) {
  std::vector<std::size_t> at(counts.size() + 1, 0);
  for (std::size_t j = 0; j < counts.size(); ++j) at[j + 1] = at[j] + counts[j];
  return at;
}

// The direct path's shared parts (direct_sync.cpp).
//
// Whether an op takes the direct path: `enabled` (its tuning switch) and bytes >= min_bytes, and
// every member is a process on this host whose memory this rank can read and write (the probe,
// run once per communicator, with messages, at its first op that calls this: every rank must call
// it for that op, whatever the size). The probe also fails the op on every rank, naming the ranks
// and the setting, where the direct tuning differs between ranks.
// `op` names the op in error texts (and the ops after it, until the next call).
bool direct_ready(op_context& c, const char* op, bool enabled, std::size_t bytes,
                  std::size_t min_bytes);
// Copies `bytes` between `local` and `remote` in peer g's process (process_vm_readv, or
// process_vm_writev when `write`); throws a lost peer as the transport reports it, else naming the
// op, rank, pid and address.
void copy_peer(op_context& c, int g, void* local, std::uint64_t remote, std::size_t bytes,
               bool write = false);
// One op of the direct path, on every rank: sends peer g the hello d.outs[g] (d.op names the op),
// runs local() (the own part, while the hellos travel), waits for every peer's hello and checks it
// with check(g) (throws naming the ranks), runs body(ends), which copies and may call poll_stops
// between pieces, then sends every peer "done with your buffer" and waits for theirs. A rank whose
// op fails tells its peers to stop and waits (bounded by the op's timeout) until none of them reads
// or writes its buffers any more before it throws (algo_direct.cpp describes the protocol).
void direct_round(op_context& c, const std::function<void()>& local,
                  const std::function<void(int)>& check,
                  const std::function<void(std::vector<p2p_request>&)>& body);
// Between pieces: throws when a peer said "stop" (its end message arrived early).
void poll_stops(op_context& c, std::vector<p2p_request>& ends, std::vector<char>& seen);
// Says that this rank left the communicator's direct ops for good (called once the communicator
// failed an op and that op returned): it reads or writes no peer's buffers any more, so a peer
// whose own op failed need not wait for this rank's end message of an op this rank never entered
// (it failed before: at the op's start, or in the probe while the peer passed it).
void direct_left(direct_state& d);
// The hello's `kind`: what the op is, so ranks that issue different ops fail naming them.
inline std::int32_t direct_kind(op_kind k, dtype t, reduce_op op) {
  return static_cast<std::int32_t>(k) << 16 | static_cast<std::int32_t>(t) << 8 |
         static_cast<std::int32_t>(op);
}

// The staged copy ops (direct_shm.cpp): all_gather and all_to_all(v) through shared-memory slot
// rings, each rank copying its blocks into its own segment and its peers' out of theirs, chunk by
// chunk while both are in cache. The probe creates and maps the segments (shm_create at its
// first round, shm_map_peers at its verdict; 0 or an errno). shm_ready: the segments exist on
// every rank and the tuning allows it at this size.
int shm_create(direct_state& d, int n, const algo_tuning& tune);
// Where the segments exist: records d.op_no and d.sig in this rank's segment, before the op runs
// on any path (one cache line, a few stores).
void shm_note_op(direct_state& d);
// Where the segments exist: throws when a peer's record of its running op has this op's number
// but says another op, kind, count or root (naming both ranks and what each issued), or when a
// peer failed its part of an op (its `failed` word). So a rank in any op, on any path, learns at
// once that a peer issued another op as this one, without a message (the staged ops have none).
void shm_check_ops(const op_context& c);
int shm_map_peers(op_context& c);
bool shm_ready(op_context& c, std::size_t bytes);
// all_gather and all_to_all(v) through the segments; each rank's record of the op in its segment
// (op, count, all_to_allv's counts) is checked by every peer before data moves, so neither takes a
// message round. all_to_allv comes here at every size where shm_ready(c, SIZE_MAX).
void all_gather_shm(op_context& c, const void* in, void* out, std::size_t count, dtype t);
void all_to_allv_shm(op_context& c, op_kind k, const void* in,
                     const std::vector<std::size_t>& send_counts, void* out,
                     const std::vector<std::size_t>& recv_counts, dtype t);

// The direct pull ops (algo_direct_pull.cpp): each rank reads what it receives from its peers'
// input buffers. Called where direct_ready said so.
void reduce_scatter_direct(op_context& c, const void* in, void* out, std::size_t count, dtype t,
                           reduce_op op);
void all_gather_direct(op_context& c, const void* in, void* out, std::size_t count, dtype t);
void all_to_allv_direct(op_context& c, op_kind k, const void* in,
                        const std::vector<std::size_t>& send_counts, void* out,
                        const std::vector<std::size_t>& recv_counts, dtype t);

// Picks the direct path where allreduce_direct_ready says so, else recursive doubling below
// tune.allreduce_ring_min bytes, else the ring.
void allreduce(op_context& c, void* data, std::size_t count, dtype t, reduce_op op);
void allreduce_recursive_doubling(op_context& c, void* data, std::size_t count, dtype t,
                                  reduce_op op);
void allreduce_ring(op_context& c, void* data, std::size_t count, dtype t, reduce_op op);
// Whether an allreduce of `count` elements of `bytes` bytes takes the direct path: the tuning
// allows it at this size and every member is a process on this host whose memory this rank can
// read (checked once per communicator, with messages, so every rank must call it for the op).
bool allreduce_direct_ready(op_context& c, std::size_t count, std::size_t bytes);
// Reduce-scatter and all-gather by process_vm_readv from the peers' buffers (algo_direct.cpp).
void allreduce_direct(op_context& c, void* data, std::size_t count, dtype t, reduce_op op);
void reduce_scatter(op_context& c, const void* in, void* out, std::size_t count, dtype t,
                    reduce_op op);
void all_gather(op_context& c, const void* in, void* out, std::size_t count, dtype t);
void broadcast(op_context& c, void* data, std::size_t count, dtype t, int root);
// all_to_all (k = op_kind::all_to_all: every count equal, the same on every rank) and
// all_to_allv (k = op_kind::all_to_allv: the counts of every pair are checked first, and a pair
// whose counts differ fails the op on both of its ranks naming them).
void all_to_allv(op_context& c, op_kind k, const void* in,
                 const std::vector<std::size_t>& send_counts, void* out,
                 const std::vector<std::size_t>& recv_counts, dtype t);
void barrier(op_context& c);

}  // namespace troupe::collective::detail
