// pipeline_runner: a pipeline stage (pipeline_stage.hpp) as a grad_producer (grad_producer.hpp):
// each step runs this stage's action list from scheduler::make_schedule over the pp communicator.
//
//   forward (mb, c)   ids from fetch(mb) on virtual stage 0, else the received activation;
//                     targets and weight from fetch(mb) on the last virtual stage (one fetch per
//                     microbatch, ascending); the output goes to a send buffer. With
//                     set_every_stage_reads (post-training) every stage fetches each microbatch
//                     at its first forward there and keeps a copy for the step, and every
//                     forward passes the microbatch's packed rows (segments, positions) to the
//                     stage: each chunk's attention stays within them
//   backward (mb, c)  the received output gradient (the loss on the last virtual stage); the
//                     input gradient goes to a send buffer. When the list also has a weight
//                     action for (mb, c) (the zero-bubble schedule), the backward computes the
//                     input gradient only and the weight action adds the parameter gradients
//                     later (pipeline_stage::weight); the block hook runs where a chunk's last
//                     gradients are complete: its last unsplit backward or weight action
//   transfers         sends are posted where the list has them and never waited for there: a
//                     send's buffer returns to the pool when the send is seen complete (polled
//                     after each compute action; at most max_sends in flight, then the oldest is
//                     waited; all at the end of the schedule). Receives are posted ahead, in list
//                     order: before compute action k runs, every receive the list has before
//                     compute action k + 1 is posted, so the next microbatch's input arrives
//                     while this one computes; a compute action waits only for its own input.
//                     Buffers are [rows, T_local, C] in the stage's dtype (f32 or bf16), from a
//                     pool that grows to the peak.
//
// Waiting less than the list's batches (each batch of consecutive transfers posted together and
// waited, Megatron's batch_isend_irecv) never deadlocks where the batched list does not: every
// stage reaches each action no later than it would with batches.
//
// Sends and receives between two stages share one FIFO (the communicator's send/recv carry no
// tag), so the constructor checks that on every link the k-th message sent is the k-th expected,
// kind and microbatch included, for the plan's microbatch count (and again for any other count).
//
// After the schedule: the tied embedding's gradient is summed between the first and the last
// stage (each sends its copy to the other and adds what it receives, so both hold the same sum),
// then every other stage sends its status (ok, or failed: below) to the last stage, which sends
// back the loss sum (sum_k weight_k * loss_k, accumulated there) with the lowest failing stage,
// so forward_backward returns the loss on every stage. Every stage's grads hold
// sum_k weight_k * d loss_k / d (its parameters). The pp communicator carries send/recv only: a
// collective on it would hang, since stages issue different numbers of sends and receives and the
// host communicator numbers collectives by the count of all ops issued (p2p_communicator.hpp).
//
// A step that fails: when a compute action throws (fetch, the stage's forward or backward, the
// block hook), the stage keeps to its action list without computing: every later compute action
// only hands its input buffer back and sends a NaN-filled output where the list sends one, so the
// peers get every message they wait for and nothing stays posted. At the end every stage sends
// its status to the last stage, which hands the lowest failing stage back with the loss; the
// failing stage then rethrows its own error and every other stage throws one naming it. The
// runner is usable for the next step (the stage's begin_step drops the failed step's state; the
// caller zeroes the gradients as for any step). Only the pp communicator's messages go on: the
// collectives a skipped compute would have issued on other communicators (tensor-parallel ones
// inside a block, data-parallel bucket reductions and ZeRO 3 gathers from the block hook) are not,
// so with tp > 1 or dp > 1 the failed rank's peers there wait until the job aborts its
// communicators (a launched run's trainer does on the first failed rank) or their op timeout. A
// stage whose stash failed half way (page_swap.hpp) refuses later steps. When a transfer fails (a
// lost peer, an aborted or broken communicator), nothing says which posted operations the peers
// will still match: the runner aborts the pp communicator, keeps its transfer buffers alive for the
// life of the process (a transport cannot cancel a posted receive, and a late message must not land
// in freed memory), rethrows, and refuses every later step with a message naming the first error.
//
// Timing of the last step: wall (the whole forward_backward), schedule (the action list: from the
// start to the last send's completion), compute (forward, backward and weight actions, the stash
// copies,
// recompute and any tensor-parallel collectives inside them included), and the time spent waiting
// for transfers. bubble_fraction() = 1 - compute / schedule: the idle share of the pipelined
// forward / backward section, the quantity (p - 1) / (v m + p - 1) predicts
// (ideal_bubble_fraction(); Narayanan et al. 2021); step_bubble_fraction() = 1 - compute / wall
// also counts the tied-embedding gradient exchange and the loss broadcast after the schedule.
// The plan's pipe_p2p = batched (parallel.pipe_p2p, --pipe-p2p batched) runs the list as Megatron
// does instead: each batch of consecutive transfers posted together and waited for where it
// stands; "async" is the default described above, "blocking" (the simulator's) is refused.
// last_trace() holds every action of the last step with its times; after trace_to(prefix)
// (parallel.pipe_trace, --pipe-trace PREFIX) each step's trace is appended to
// <prefix>.stage<s>.<pid>.txt, one line per action: step, kind, microbatch, chunk, start and end
// in ms from the step's start (compute: the run; receive: the wait for it; send: posted, and seen
// complete) and the thread's CPU ms in it (compute only, else 0), then "step wall -1 -1 0 <wall
// ms> 0" and "step t0 -1 -1 0 <the step's start in ms on steady_clock> 0" (one clock for the
// processes of a host); scripts/bench/pipe_trace.py reads them.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "collective/communicator.hpp"
#include "models/parallel/grad_producer.hpp"
#include "models/parallel/pipeline_stage.hpp"
#include "scheduler/pipeline.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models::parallel {

struct pipeline_timing {
  double wall_s = 0;      // the whole forward_backward
  double schedule_s = 0;  // the action list, from the start to the last send's completion
  double compute_s = 0;   // forward and backward actions
  double wait_s = 0;      // waiting for transfers (schedule, tied gradient, loss)
  int microbatches = 0;
};

// One action of the last step and when it ran, in seconds from the start of forward_backward;
// cpu_s: for a compute action, the CPU time the running thread spent in it (the wall time minus
// what other threads of the machine took from it: the compute's own cost on a shared machine).
struct pipeline_event {
  scheduler::action what;
  double start_s = 0, end_s = 0;
  double cpu_s = 0;
};

class pipeline_runner final : public grad_producer {
 public:
  // pp: ranks = stages in order (pp.rank() == stage.stage()); plan: pp, tp, sp, schedule,
  // microbatches, virtual_stages and recompute are checked against the stage and pp (recompute
  // full needs a stage built with recompute; selective is refused). norm_group: the model-parallel
  // ranks (pp x tp) of this replica, or null. The stage and the communicators must outlive the
  // runner.
  pipeline_runner(pipeline_stage& stage, collective::communicator& pp,
                  const scheduler::parallel_plan& plan,
                  collective::communicator* norm_group = nullptr);

  layer_memory& memory() override { return stage_.memory(); }
  const slot_list& slots() const override { return stage_.slots(); }
  double forward_backward(int microbatches,
                          const std::function<microbatch_data(int k)>& fetch) override;
  bool set_block_grads_hook(std::function<void(std::int64_t block)> f) override;
  void set_every_stage_reads(bool on) override { every_stage_reads_ = on; }
  collective::communicator* norm_group() override { return norm_group_; }
  bool counts_in_norm(const tensor_slot& parameter) const override {
    return stage_.counts_in_norm(parameter);
  }

  pipeline_stage& stage() { return stage_; }
  // After a step that gave up its transfers: the caller has made the pp communicator (and every
  // other one this stage uses) new, with a new group id, so no message of the old ones can reach
  // it (actors/training.hpp, elastic recovery through a rebindable communicator). The runner takes
  // steps again; the old transfer buffers stay where abandon() put them.
  void revive() { broken_.clear(); }
  // This stage's actions for a step of `microbatches` (checked as the constructor does).
  const std::vector<scheduler::action>& schedule(int microbatches);

  const pipeline_timing& last_timing() const { return timing_; }
  // 1 - compute / schedule of the last step (0 before the first), in [0, 1).
  double bubble_fraction() const;
  // 1 - compute / wall of the last step: the exchanges after the schedule count as idle too.
  double step_bubble_fraction() const;
  const std::vector<pipeline_event>& last_trace() const { return trace_; }
  // Appends each step's trace to <prefix>.stage<s>.<pid>.txt from now on ("": no more); the file
  // is opened at once, so a bad prefix throws here, naming parallel.pipe_trace.
  void trace_to(const std::string& prefix);
  // Sends allowed in flight before the oldest is waited for (>= 1).
  static constexpr int max_sends = 4;
  // The schedule's idle share with equal forward and backward times and free transfers:
  // (p - 1) / (v m + p - 1).
  static double ideal_bubble_fraction(int stages, int microbatches, int virtual_stages = 1);

 private:
  int take_buffer();
  void forward(const scheduler::action& a, const std::function<microbatch_data(int k)>& fetch);
  void backward(const scheduler::action& a);
  void weight(const scheduler::action& a);
  bool split(int mb, int chunk) const;  // the list has a weight action for (mb, chunk)
  void post_receives(std::size_t until);
  void wait_input(const scheduler::action& a);
  void wait_recv(const scheduler::action& r);
  void post_send(const scheduler::action& a);
  void reap_sends(bool all);
  void write_trace();
  double now() const;
  void run_schedule(const std::vector<scheduler::action>& acts,
                    const std::function<microbatch_data(int k)>& fetch);
  void skip(const scheduler::action& a);
  void abandon(const std::string& why);
  void exchange_tied_grad();
  int share_loss(int failed);
  int& table(scheduler::action_kind k, int mb, int chunk);

  pipeline_stage& stage_;
  collective::communicator& pp_;
  collective::communicator* norm_group_;
  scheduler::parallel_plan plan_;
  int schedule_m_ = -1;
  std::vector<scheduler::action> actions_;
  // post_until_[i] for a compute action i: the receives listed before this index are posted
  // before it runs (those up to the compute action after it).
  std::vector<std::size_t> post_until_;
  std::function<void(std::int64_t)> hook_;
  // Calls hook_ during the action that completes a chunk's gradients: its last unsplit backward
  // or weight action.
  block_hook after_block_;
  bool last_backward_ = false;

  // Transfer buffers: a pool, and per (microbatch, chunk) the pool entry holding its received
  // activation, its output, its received gradient and its input gradient (-1: none).
  std::vector<owned_tensor> pool_;
  std::vector<int> free_;
  std::vector<int> act_in_, act_out_, grad_in_, grad_out_;
  std::vector<int> backwards_done_;  // per chunk, this step
  // per chunk, this step: microbatches whose gradients are complete (unsplit backward or weight)
  std::vector<int> grads_done_;
  std::vector<char> split_;  // per (microbatch, chunk): the list has its weight action
  std::vector<collective::work> pending_;    // loss and tied gradient
  std::vector<collective::work> recv_work_;  // per (microbatch, chunk, kind 0 act / 1 grad)
  struct in_flight_send {
    collective::work w;
    int buffer;
    std::size_t event;
  };
  std::vector<in_flight_send> sends_;  // oldest first
  std::size_t next_recv_ = 0;          // the first action index not yet looked at for posting
  std::chrono::steady_clock::time_point t0_;
  std::vector<pipeline_event> trace_;
  std::string trace_path_;  // trace_to: where each step's trace is appended
  bool batched_ = false;    // parallel.pipe_p2p = batched: wait for each transfer batch in place
  int steps_ = 0;
  int fetched_ = -1;  // the last microbatch fetched
  microbatch_data data_;
  // set_every_stage_reads: every stage fetches; each microbatch's data is kept (owned copies)
  // until the step ends, since a stage's later chunks read it after other fetches.
  bool every_stage_reads_ = false;
  struct kept_microbatch {
    owned_tensor ids, targets, segments, positions;
    microbatch_data data;  // views of the above, the weight and the objective
  };
  std::vector<kept_microbatch> kept_;
  const microbatch_data& keep(int mb, const std::function<microbatch_data(int k)>& fetch);
  double loss_sum_ = 0;
  owned_tensor tied_recv_;
  owned_tensor msg_;  // f64 [p + 1]: the stages' statuses, then the loss and the status
  pipeline_timing timing_;
  std::exception_ptr failure_;  // this step's first compute failure
  std::string broken_;          // why a step gave up its transfers (the runner is unusable)
};

}  // namespace troupe::models::parallel
