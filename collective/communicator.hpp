// The communicator interface: every collective and point-to-point operation troupe uses.
//
// Ops take flat typed buffers and an options struct and return a work handle (c10d style). Buffers
// must stay alive and untouched until the work completes. Reductions of bf16 and f16 accumulate in
// f32. All ranks of a communicator must issue the same operations in the same order with matching
// counts and dtypes (the debug wrapper, collective/debug.hpp, checks this). Backends: ucx/ (host
// memory, processes), nccl/ (device memory), local/ (ranks as threads, for tests).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "tensor/dtype.hpp"

namespace troupe::collective {

enum class reduce_op : std::uint8_t { sum, avg, max };
const char* reduce_op_name(reduce_op op);

enum class op_kind : std::uint8_t {
  allreduce,
  reduce_scatter,
  all_gather,
  broadcast,
  all_to_all,
  all_to_allv,
  send,
  recv,
  barrier
};
const char* op_kind_name(op_kind k);

// The deadline a communicator gives every op whose options::timeout is 0, until set_timeout
// changes it: generous, so that no slow but healthy run meets it (a launched job sets it from
// parallel.collective_timeout).
inline constexpr std::chrono::milliseconds default_op_timeout{std::chrono::minutes(10)};

struct options {
  reduce_op op = reduce_op::sum;
  int root = 0;  // broadcast: the group rank whose buffer is sent
  // This op's deadline, counted from when it starts on this rank; 0 = the communicator's
  // (set_timeout). At the deadline the op fails naming the ranks it still waits for, and the
  // communicator is aborted (every pending and later op on it fails pointing to that op).
  std::chrono::milliseconds timeout{0};
  void* stream = nullptr;  // CUDA stream (cudaStream_t) for device backends; ignored on the host
};

namespace detail {
struct work_state;
}

// A handle on an issued operation. Cheap to copy (shared state).
class work {
 public:
  work() = default;
  explicit work(std::shared_ptr<detail::work_state> s) : s_(std::move(s)) {}
  // Blocks until done; throws troupe::error if the operation failed (naming op, group and cause).
  void wait();
  // True when done (throws if it failed).
  bool test();
  // Device backends: make `stream` wait for the operation without blocking the host.
  void wait_stream(void* stream);
  bool valid() const { return s_ != nullptr; }
  detail::work_state* state() const { return s_.get(); }

 private:
  std::shared_ptr<detail::work_state> s_;
};

// One entry of the flight recorder: what a rank issued recently and how it ended.
struct flight_record {
  std::uint64_t seq = 0;  // per-communicator sequence number, starting at 1
  op_kind kind = op_kind::barrier;
  dtype type = dtype::f32;
  std::size_t count = 0;  // elements (per rank for reduce_scatter / all_gather / all_to_all)
  int peer = -1;          // send/recv peer or broadcast root (group rank)
  std::string state;      // "issued", "running", "done", "failed: ..."
  double start_us = 0;    // microseconds since the communicator was made
  double end_us = 0;      // 0 while unfinished
};

class communicator {
 public:
  virtual ~communicator() = default;
  virtual int rank() const = 0;  // rank in this group
  virtual int size() const = 0;
  virtual std::string name() const = 0;  // backend and group, e.g. "ucx:tp#3[0,1]"

  // In place: data holds count elements on every rank; afterwards the reduction on every rank.
  virtual work allreduce(void* data, std::size_t count, dtype t, const options& o = {}) = 0;
  // in: size()*count elements; out: count elements, the reduced block rank() of in.
  virtual work reduce_scatter(const void* in, void* out, std::size_t count, dtype t,
                              const options& o = {}) = 0;
  // in: count elements; out: size()*count elements, block r from group rank r.
  virtual work all_gather(const void* in, void* out, std::size_t count, dtype t,
                          const options& o = {}) = 0;
  // data: count elements, sent from o.root to every rank.
  virtual work broadcast(void* data, std::size_t count, dtype t, const options& o = {}) = 0;
  // in and out: size()*count elements; block j of in goes to rank j, block i of out came from rank
  // i.
  virtual work all_to_all(const void* in, void* out, std::size_t count, dtype t,
                          const options& o = {}) = 0;
  // Variable splits: send_counts[j] elements (consecutive in `in`) to rank j; recv_counts[i] from
  // i.
  virtual work all_to_allv(const void* in, std::span<const std::size_t> send_counts, void* out,
                           std::span<const std::size_t> recv_counts, dtype t,
                           const options& o = {}) = 0;
  virtual work send(const void* data, std::size_t count, dtype t, int peer,
                    const options& o = {}) = 0;
  virtual work recv(void* data, std::size_t count, dtype t, int peer, const options& o = {}) = 0;
  virtual work barrier(const options& o = {}) = 0;

  // The deadline of ops issued afterwards whose options::timeout is 0 (default_op_timeout until
  // set; 0 = none: only a lost peer or abort() ends a stuck op).
  virtual void set_timeout(std::chrono::milliseconds timeout) = 0;

  // Fails every pending and later operation with `reason` (used when a peer is lost).
  virtual void abort(const std::string& reason) = 0;
  // The flight recorder: the most recent operations, oldest first.
  virtual std::vector<flight_record> recent() const = 0;
};

}  // namespace troupe::collective
