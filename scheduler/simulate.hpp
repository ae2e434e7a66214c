// simulate(): runs every stage's action list against the others on a model clock.
//
// Each stage executes its list in order, starting at time 0. A compute action occupies the stage
// for its cost. Transfers rendezvous: one starts when both its send and its matching receive are
// posted and takes cost.p2p, and both sides complete then (a send blocks like an unbuffered NCCL
// send). With p2p_mode::batched, consecutive communication actions are posted together and the
// stage waits for all of them (batch_isend_irecv, how pipeline.hpp's lists are meant to run); with
// p2p_mode::blocking each transfer is posted only after the previous one completed. p2p_mode::async
// is how pipeline_runner runs a list by default: a send is buffered and never waited for (its
// message is there cost.p2p later), a receive is posted where the list has it, and a forward or
// backward waits only until its own input is there. In async mode a deadlock is a compute whose
// input is never sent, or a send that no stage receives (the runner would wait for it).
//
// A receive matches the send of the same kind, microbatch and virtual stage (chunk * p + stage,
// p = number of lists); the simulator also checks every dependency a real stage relies on
// (forward after its input arrived, backward after its forward and its output's gradient, sends
// after the compute that produced them, each (microbatch, chunk) computed once, a weight action
// at most once and after the backward of the same (microbatch, chunk) on the same stage) and
// reports the first broken one, or a deadlock naming the stage and action that can never proceed.
// A weight action is a compute with no transfer: it ends a batch and, in async mode, never waits.
#pragma once

#include <string>
#include <vector>

#include "scheduler/pipeline.hpp"
#include "scheduler/plan.hpp"

namespace troupe::scheduler {

// Model-clock costs of one action on one (microbatch, chunk).
struct cost {
  double forward = 1.0;
  double backward = 1.0;  // the full backward (input and parameter gradients)
  double p2p = 0.0;
  // The part of `backward` a split moves to its weight action: a backward whose (microbatch,
  // chunk) has a weight action in the same list costs backward - weight, the weight action
  // weight. Must be in [0, backward] when any list splits a backward.
  double weight = 0.0;
};

// p2p_mode (batched, blocking, async): scheduler/plan.hpp.

struct simulation {
  std::string error;  // empty on success; otherwise what went wrong (stage, action, cause)
  double makespan = 0;
  std::vector<double> busy;    // per stage: time spent computing
  std::vector<double> idle;    // per stage: makespan - busy (waiting, transferring, bubbles)
  double bubble_fraction = 0;  // sum(idle) / (stages * makespan)
  // Per stage: the most (microbatch, chunk) forwards whose backward has not run yet (for a split
  // backward: whose weight action has not run yet), i.e. the activation sets held at once (each is
  // 1/v of a stage's layers with v chunks per stage).
  std::vector<int> peak_in_flight;
  // Per stage and action: when it started and finished (for a transfer: posted and completed).
  std::vector<std::vector<double>> start, finish;

  bool ok() const { return error.empty(); }
};

simulation simulate(const std::vector<std::vector<action>>& schedules, const cost& c = {},
                    p2p_mode mode = p2p_mode::batched);

// A text timeline, one row per stage and one column per `unit` of model time: "F3" / "B3" / "W3"
// for the forward / backward / weight pass of microbatch 3 ("F3.1" for chunk 1 when stages hold
// several chunks), "." for idle. For docs and for the message of a failing test.
std::string timeline(const std::vector<std::vector<action>>& schedules, const simulation& sim,
                     double unit = 1.0);

}  // namespace troupe::scheduler
