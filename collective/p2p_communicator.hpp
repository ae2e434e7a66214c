// The host communicator: every collective of communicator.hpp built from point-to-point messages
// over any `transport` (collective/ucx between processes, collective/local between threads).
//
// One executor thread per communicator runs the issued collectives in issue order; the caller gets
// its work handle at once. A caller that waits on an op the executor has not started yet runs it
// inline instead (no thread hand-off for the small blocking case). send/recv are posted in issue
// order but never block the executor, so a rank may issue send then recv while its peer does the
// same. Messages carry the tag (group id << 15) | seq (collectives) or (group id << 15) | 1 << 14
// (send/recv), so communicators over one transport never cross and bit 47 stays 0 (actors/ owns
// it).
//
// An op that fails (a lost peer, its timeout, abort()) fails its work with "<op> #<seq> on <name>
// failed: <cause>"; the communicator is then unusable and every later op fails at once, naming the
// first failure. Make a new communicator (new group id) over the survivors to go on. Every op has a
// deadline (options::timeout, else set_timeout's, default_op_timeout by default): past it the op
// fails with "deadline of T ms passed (waited W ms; <dtype> x <count>, group ranks ...): rank R is
// waiting for rank P (...); messages of this op arrived from rank ..." and the communicator is
// aborted, so this rank's queued ops fail too ("aborted: rank R gave up <op> ...").
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "collective/communicator.hpp"
#include "collective/grid.hpp"
#include "collective/transport.hpp"

namespace troupe::collective {

// Algorithm switch points and pipelining, in bytes of the user's dtype; the same on every rank of a
// group. Defaults measured with `troupe bench collective --ring-min/--chain-min/--chunk` on the
// project's 2-CPU machine, UCX ranks (docs/performance.md): recursive doubling and the ring tie at
// 2 ranks up to 512 KiB, and at 4 ranks recursive doubling wins at 64 KiB (108 vs 154 us) and the
// ring from 128 KiB (318 vs 358 us at 256 KiB); the binomial tree beats the chain at 4 ranks up
// to 1 MiB and they tie at 2 MiB. Chunks: with cma moving large messages (one rendezvous per
// chunk), 1 MiB chunks beat 256 KiB ones at 2 ranks (allreduce busbw 1 MiB: 3.6 vs 3.3 GB/s, 256
// MiB: 0.48 vs 0.27, medians of 3 under load 13; 64 KiB was slower still), and 2 MiB ones beat
// 1 MiB at 4 and 16 MiB (best of 4, load 2: 5.7 vs 4.8 and 6.1 vs 5.4 GB/s; 4 ranks: a tie).
// Tests lower the thresholds to cover every path at every size.
struct algo_tuning {
  std::size_t allreduce_ring_min = 128 * 1024;  // below: recursive doubling, from here: ring
  std::size_t broadcast_chain_min = 2 << 20;    // below: binomial tree, from here: chain
  std::size_t chunk_bytes = 2 << 20;            // pipeline chunk of ring and chain steps
  int window = 4;                               // receives posted ahead in pipelined loops
  // Allreduce when every rank of the group is a process on this host: from this many bytes the
  // direct algorithm (each rank reduces its slice reading the peers' buffers with process_vm_readv
  // in pieces of direct_piece_bytes and writes each reduced piece back into every peer with
  // process_vm_writev; collective/README.md).
  // allreduce_direct = false keeps to the ring and recursive doubling (also the fallback where the
  // kernel forbids reading another process's memory). Measured (nice -10, load ~8, direct vs
  // the rest): 2 ranks 16 KiB 7.9-8.8 vs 6.7-7.0 us, 32 KiB 9.1-10.7 vs 11.8 us; 4 ranks 32 KiB
  // 44-46 vs 39-43 us, 64 KiB 52-54 vs 67-82 us. 128 KiB pieces were as good as any from 32 to
  // 512 KiB.
  bool allreduce_direct = true;
  std::size_t allreduce_direct_min = 64 * 1024;
  std::size_t direct_piece_bytes = 128 * 1024;
  // reduce_scatter, all_gather, all_to_all and all_to_allv between processes of one host: each
  // rank pulls what it receives straight from its peers' input buffers with process_vm_readv
  // (collective/algo_direct_pull.cpp), from these sizes (the op's nccl-tests size: the input of
  // reduce_scatter, the output of all_gather, one rank's send buffer of all_to_all; all_to_allv
  // from all_to_all_direct_min bytes in the largest send buffer of any rank, which its count check
  // tells every rank). pull_direct = false keeps them on messages.
  // Copies go in pieces of direct_copy_bytes (between pieces the op checks its deadline and
  // stops).
  // Measured (troupe bench collective --pull-direct-min 1 or the defaults vs --no-direct,
  // interleaved, load 7-10): the direct ops cost two rounds of small messages where the pairwise
  // exchange costs one (2 ranks 4 KiB: 4.8 vs 2.0 us; 4 ranks on 2 CPUs: 31 vs 10 us), and
  // below UCX's rendezvous (256 KiB messages) its shared-memory path beats one process_vm_readv
  // copy per byte (2 ranks 256 KiB: all_gather 12.5-36 vs 8.9-15.7 us, reduce_scatter 14-15 vs
  // 11 us). From there both move the data with process_vm_readv and tie at 2 ranks (1 MiB
  // all_gather 47-76 vs 49-112 us, 4 MiB 195-199 vs 211-217), while at 4 ranks the direct path
  // saves the ring's steps (all_gather 4 MiB 545-549 vs 628-633 us, 16 MiB 3.2-3.4 vs 4.0-4.2 ms;
  // reduce_scatter 4 MiB 739-762 vs 1240-1287 us); all_to_all ties at 4 ranks up to 1 MiB
  // (145 vs 143-161 us).
  bool pull_direct = true;
  std::size_t reduce_scatter_direct_min = 512 * 1024;
  std::size_t all_gather_direct_min = 512 * 1024;
  std::size_t all_to_all_direct_min = 1 << 20;
  std::size_t direct_copy_bytes = 1 << 20;
  // all_gather and all_to_all(v) between processes of one host from shm_min bytes (the op's
  // nccl-tests size), where every rank could map every peer's shared-memory segment: staged
  // through per-peer rings of shm_slots slots of shm_slot_bytes (collective/direct_shm.cpp), two
  // user-space copies of each byte while it is in cache, which beat one process_vm_readv copy
  // (its page pinning costs ~350 ns per 4 KiB page here). Measured (load 6-7, --shm-min 1 vs
  // --no-shm): 2 ranks all_gather 1 MiB 28-34 vs 45-47 us, 4 MiB 130-155 vs 193-202 us; 4 ranks
  // 1 MiB 62 vs 139 us, all_to_all 4 MiB 550 vs 846 us; at 64 KiB a tie (2.9-7.9 vs 3.0-5.7 us),
  // at 16 KiB the messages win (1.2-1.4 vs 2.0-3.3 us). 32 KiB x 16, 64 KiB x 8 and 128 KiB x 4
  // slots were alike. shm = false keeps them on the pull ops and messages. (Measured with the
  // hello round the staged ops had then; without it, issue 18 h-coll3, all_to_allv takes the
  // staged path at every size: 2 ranks 1 KiB 1.1 against 2.5 us through the count exchange.)
  bool shm = true;
  std::size_t shm_min = 64 * 1024;
  std::size_t shm_slot_bytes = 64 * 1024;
  int shm_slots = 8;
  // Staged ops whose output reaches this many bytes write it with streaming stores (no read for
  // ownership of lines that are not cached anyway).
  std::size_t shm_stream_min = 16 << 20;
  int executor_spin_us = 20;  // how long an idle executor polls for new ops before sleeping
                              // (never when the process may use only one CPU)
};

namespace detail {
struct comm_core;
}

class p2p_communicator final : public communicator {
 public:
  // `owner` is kept alive as long as the communicator (what owns the transport, if anyone).
  p2p_communicator(transport& t, const rank_group& g, std::string backend_name,
                   std::shared_ptr<void> owner = nullptr);
  ~p2p_communicator() override;
  p2p_communicator(const p2p_communicator&) = delete;
  p2p_communicator& operator=(const p2p_communicator&) = delete;

  int rank() const override;
  int size() const override;
  std::string name() const override;

  work allreduce(void* data, std::size_t count, dtype t, const options& o = {}) override;
  work reduce_scatter(const void* in, void* out, std::size_t count, dtype t,
                      const options& o = {}) override;
  work all_gather(const void* in, void* out, std::size_t count, dtype t,
                  const options& o = {}) override;
  work broadcast(void* data, std::size_t count, dtype t, const options& o = {}) override;
  work all_to_all(const void* in, void* out, std::size_t count, dtype t,
                  const options& o = {}) override;
  work all_to_allv(const void* in, std::span<const std::size_t> send_counts, void* out,
                   std::span<const std::size_t> recv_counts, dtype t,
                   const options& o = {}) override;
  work send(const void* data, std::size_t count, dtype t, int peer, const options& o = {}) override;
  work recv(void* data, std::size_t count, dtype t, int peer, const options& o = {}) override;
  work barrier(const options& o = {}) override;

  void set_timeout(std::chrono::milliseconds timeout) override;
  void abort(const std::string& reason) override;
  std::vector<flight_record> recent() const override;

  // Takes effect for ops issued afterwards; the same on every rank of the group.
  void set_tuning(const algo_tuning& t);
  algo_tuning tuning() const;

 private:
  std::shared_ptr<detail::comm_core> core_;
};

// The communicator of group `g` (which must contain t.rank()) over transport `t`. `backend_name`
// starts the name: "ucx" gives "ucx#<id>[r0,r1,...]"; "ucx:tp" gives "ucx:tp#<id>[...]".
std::unique_ptr<communicator> make_communicator(transport& t, const rank_group& g,
                                                std::string backend_name = "ucx");
// The same, keeping `owner` (e.g. the object that owns `t`) alive as long as the communicator.
std::unique_ptr<communicator> make_communicator(transport& t, const rank_group& g,
                                                std::string backend_name,
                                                std::shared_ptr<void> owner);

}  // namespace troupe::collective
