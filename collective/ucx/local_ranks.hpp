// Runs a body on N forked local ranks connected by ucx_transport: for tests and benchmarks only
// (production launches go through actors/, which exchanges addresses over CAF).
//
// The parent forks N children; each makes its own ucx_transport after the fork (no UCX state is
// inherited), sends its worker address to the parent over a socketpair, gets everyone's back,
// connects to every peer and runs `body`. The parent supervises: when a child dies (or its body
// fails), every survivor is told over its socketpair and a small thread in the survivor calls
// transport.fail_peer(k, "rank k died: signal 9") - a stand-in for the membership layer, so tests
// can prove that a peer killed mid-operation fails the operation instead of hanging. Children
// that finish wait until every rank has finished (their transports stay alive for late
// receivers), then leave with _exit(body's code): no Catch2 or static destructors run in a child.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "collective/ucx/ucx_transport.hpp"

namespace troupe::collective {

// How one child ended.
struct rank_outcome {
  int rank = -1;
  int exit_code = -1;  // when it exited normally
  int signal = 0;      // when a signal ended it (SIGKILL for the ranks the parent killed)
  bool hung = false;   // killed by the parent after the timeout
  bool ok() const { return !hung && signal == 0 && exit_code == 0; }
  std::string describe() const;  // "rank 1 killed by signal 9 (Killed)"
};

struct local_ranks_options {
  // After this long the parent kills every child still running and reports a hang.
  std::chrono::milliseconds timeout = std::chrono::seconds(120);
  // Pin child i to the i-th CPU (mod count) this process may run on. Use it for benchmarks.
  bool pin_cpus = false;
  bool progress_thread = true;                            // ucx_transport_options::progress_thread
  std::string net_device = "lo";                          // ucx_transport_options::net_device
  ucx_error_mode error_mode = ucx_error_mode::automatic;  // ucx_transport_options::error_mode
  bool single_copy = true;                                // ucx_transport_options::single_copy
  // Where to write every rank's outcome (optional).
  std::vector<rank_outcome>* outcomes = nullptr;
};

// Returns 0 when every child exited with code 0; otherwise 1, after printing to stderr which ranks
// failed and how (exit code, signal or hang). Call it from a thread of a process that owns no live
// UCX objects; it blocks until every child is gone.
int run_local_ranks(int n, std::function<int(ucx_transport&)> body,
                    local_ranks_options options = {});

}  // namespace troupe::collective
