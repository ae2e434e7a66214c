// The NCCL backend of the communicator interface (collective/communicator.hpp): collectives and
// point-to-point ops on device memory, one rank per GPU.
//
// Plain C++: no CUDA or NCCL header is needed to include this; streams travel as `void*`
// (cudaStream_t). The definitions exist only in builds with CUDA and NCCL (TROUPE_HAVE_NCCL).
//
// Making one: rank 0 calls make_nccl_unique_id() (works without a GPU), the actor runtime gives
// the 128 bytes to every rank, and every rank calls make_nccl_communicator() with its rank, the
// group size, the id and its CUDA device. The NCCL communicator is non-blocking (NCCL polls for
// progress instead of blocking inside its calls), so a lost peer or a timeout never hangs a host
// thread: abort() or the timeout in nccl_options ends every pending and later op with a reason.
//
// Ops are enqueued on options::stream, or on the communicator's own stream when that is null (a
// blocking stream: it orders after work on the legacy default stream). A work handle records a CUDA
// event after the op: wait() polls it (and NCCL's asynchronous error), wait_stream(s) makes stream
// s wait for it without blocking the host.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <string>

#include "collective/communicator.hpp"

namespace troupe::collective {

// The bytes of an ncclUniqueId (NCCL_UNIQUE_ID_BYTES = 128).
using nccl_unique_id = std::array<char, 128>;

// A fresh id for one communicator. Rank 0 makes it; the other ranks receive the bytes. Needs no
// GPU. Throws troupe::error if NCCL cannot make one (no usable network interface for its bootstrap:
// set NCCL_SOCKET_IFNAME, e.g. to "lo" for a single host).
nccl_unique_id make_nccl_unique_id();

struct nccl_options {
  std::string group = "world";  // names the communicator in messages: "nccl:<group>"
  // Deadline for creating the communicator, and for each op whose options::timeout is 0. An op
  // past its deadline aborts the communicator with a reason naming the op. 0 = no deadline.
  std::chrono::milliseconds timeout = default_op_timeout;  // set_timeout changes it for ops
  std::size_t flight_records = 256;  // entries kept by the flight recorder (at least 1)
};

// Creates this rank's communicator on CUDA device `device` (all ranks call it, each with its own
// rank and the same id and size; it returns when every rank has joined or the timeout passed).
// Reductions take f32, f64, bf16 and f16 (NCCL rounds 16-bit sums after each pairwise step, so
// with more than two ranks a result can differ in the last bit from one f32 accumulation); the
// data-movement ops take every dtype. Throws troupe::error for a bad rank, size or device, when
// there is no GPU, or when NCCL fails.
std::unique_ptr<communicator> make_nccl_communicator(int rank, int size, const nccl_unique_id& id,
                                                     int device, nccl_options opts = {});

}  // namespace troupe::collective
