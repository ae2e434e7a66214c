// The shared state behind a work handle (collective/communicator.hpp), and the hooks a backend
// overrides.
//
// A backend makes one work_state (or a type derived from it) per issued op and hands it out inside
// a `work`. Host backends finish it from their executor with complete() or fail(); the default
// wait() spins briefly, then sleeps on the status word (a futex), so a waiter costs no CPU while a
// long op runs. A device backend (collective/nccl) derives from work_state and overrides the hooks:
// test() and wait() poll or synchronize its CUDA event, wait_stream() enqueues a stream wait on it.
// Every override must leave `status` and `error` as the base does, so work::wait() and the flight
// recorder see one truth.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <utility>

#include "collective/communicator.hpp"

namespace troupe::collective::detail {

struct work_state {
  work_state() = default;
  work_state(op_kind k, std::uint64_t seq, std::string comm_name)
      : kind(k), seq(seq), comm(std::move(comm_name)) {}
  work_state(const work_state&) = delete;
  work_state& operator=(const work_state&) = delete;
  virtual ~work_state() = default;

  // Which op this is, for error messages: "allreduce #7 on ucx:tp#3[0,1]".
  op_kind kind = op_kind::barrier;
  std::uint64_t seq = 0;
  std::string comm;
  std::string describe() const;

  enum : int { pending = 0, done = 1, failed = 2 };
  std::atomic<int> status{pending};
  std::string error;  // the full message; written before status becomes `failed`

  // Finish the op and wake every waiter. The first of complete()/fail() wins; later calls return
  // false and change nothing (an abort racing the executor is harmless).
  bool complete();
  bool fail(std::string message);

  bool finished() const { return status.load(std::memory_order_acquire) != pending; }
  // Whether wait() may spin before it yields: false when the process may run on one CPU only,
  // where spinning keeps the thread that would finish the op (the executor) off that CPU.
  bool spin = true;
  // Throws troupe::error with `error` when the op failed.
  void throw_if_failed() const;

  // Hooks (defaults: host memory, the op is finished when `status` says so).
  // True once the op finished; throws if it failed.
  virtual bool test();
  // Blocks until the op finished (spin ~20 us, then yield, then sleep on `status`); throws if it
  // failed.
  virtual void wait();
  // Makes a CUDA stream wait for the op. Host ops: waits on the host (the data is then ready for
  // any later stream work, so this is correct if not asynchronous).
  virtual void wait_stream(void* stream);

 private:
  bool finish(int to, std::string* message);
  std::atomic<bool> claimed_{false};
};

}  // namespace troupe::collective::detail
