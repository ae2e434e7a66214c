// pipeline_runner: a pipeline stage (pipeline_stage.hpp) as a grad_producer (grad_producer.hpp):
// each step runs this stage's action list from scheduler::make_schedule over the pp communicator.
//
//   forward (mb, c)   ids from fetch(mb) on virtual stage 0, else the received activation;
//                     targets and weight from fetch(mb) on the last virtual stage (one fetch per
//                     microbatch, ascending); the output goes to a send buffer
//   backward (mb, c)  the received output gradient (the loss on the last virtual stage); the
//                     input gradient goes to a send buffer
//   transfers         each run of consecutive transfer actions (one Megatron batch) is posted
//                     together with the communicator's send / recv and then waited; buffers are
//                     f32 [rows, T_local, C] from a pool that grows to the schedule's peak
//
// Sends and receives between two stages share one FIFO (the communicator's send/recv carry no
// tag), so the constructor checks that on every link the k-th message sent is the k-th expected,
// kind and microbatch included, for the plan's microbatch count (and again for any other count).
//
// After the schedule: the tied embedding's gradient is summed between the first and the last
// stage (each sends its copy to the other and adds what it receives, so both hold the same sum),
// then the last stage sends the loss sum (sum_k weight_k * loss_k, accumulated there) to every
// other stage, so forward_backward returns it on every stage. Every stage's grads hold
// sum_k weight_k * d loss_k / d (its parameters). The pp communicator carries send/recv only: a
// collective on it would hang, since stages issue different numbers of sends and receives and the
// host communicator numbers collectives by the count of all ops issued (p2p_communicator.hpp).
//
// Timing of the last step: wall (the whole forward_backward), compute (forward and backward
// actions, the stash copies and any tensor-parallel collectives inside them included), and the
// time spent waiting for transfers; bubble_fraction() = 1 - compute / wall, to compare with
// ideal_bubble_fraction() = (p - 1) / (v m + p - 1).
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include "collective/communicator.hpp"
#include "models/parallel/grad_producer.hpp"
#include "models/parallel/pipeline_stage.hpp"
#include "scheduler/pipeline.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models::parallel {

struct pipeline_timing {
  double wall_s = 0;     // the whole forward_backward
  double compute_s = 0;  // forward and backward actions
  double wait_s = 0;     // waiting for transfers (schedule, tied gradient, loss)
  int microbatches = 0;
};

class pipeline_runner final : public grad_producer {
 public:
  // pp: ranks = stages in order (pp.rank() == stage.stage()); plan: pp, tp, sp, schedule,
  // microbatches, virtual_stages and recompute are checked against the stage and pp (recompute
  // must be none). norm_group: the model-parallel ranks (pp x tp) of this replica, or null. The
  // stage and the communicators must outlive the runner.
  pipeline_runner(pipeline_stage& stage, collective::communicator& pp,
                  const scheduler::parallel_plan& plan,
                  collective::communicator* norm_group = nullptr);

  layer_memory& memory() override { return stage_.memory(); }
  const slot_list& slots() const override { return stage_.slots(); }
  double forward_backward(int microbatches,
                          const std::function<microbatch_data(int k)>& fetch) override;
  bool set_block_grads_hook(std::function<void(std::int64_t block)> f) override;
  collective::communicator* norm_group() override { return norm_group_; }
  bool counts_in_norm(std::string_view parameter) const override {
    return stage_.counts_in_norm(parameter);
  }

  pipeline_stage& stage() { return stage_; }
  // This stage's actions for a step of `microbatches` (checked as the constructor does).
  const std::vector<scheduler::action>& schedule(int microbatches);

  const pipeline_timing& last_timing() const { return timing_; }
  // 1 - compute / wall of the last step (0 before the first), in [0, 1).
  double bubble_fraction() const;
  // The schedule's idle share with equal forward and backward times and free transfers:
  // (p - 1) / (v m + p - 1).
  static double ideal_bubble_fraction(int stages, int microbatches, int virtual_stages = 1);

 private:
  int take_buffer();
  void forward(const scheduler::action& a, const std::function<microbatch_data(int k)>& fetch);
  void backward(const scheduler::action& a);
  void transfers(const std::vector<scheduler::action>& acts, std::size_t begin, std::size_t end);
  void exchange_tied_grad();
  void share_loss();
  int& table(scheduler::action_kind k, int mb, int chunk);

  pipeline_stage& stage_;
  collective::communicator& pp_;
  collective::communicator* norm_group_;
  scheduler::parallel_plan plan_;
  int schedule_m_ = -1;
  std::vector<scheduler::action> actions_;
  std::function<void(std::int64_t)> hook_;
  block_hook after_block_;  // calls hook_ during the last backward of a chunk
  bool last_backward_ = false;

  // Transfer buffers: a pool, and per (microbatch, chunk) the pool entry holding its received
  // activation, its output, its received gradient and its input gradient (-1: none).
  std::vector<owned_tensor> pool_;
  std::vector<int> free_;
  std::vector<int> act_in_, act_out_, grad_in_, grad_out_;
  std::vector<int> backwards_done_;  // per chunk, this step
  std::vector<collective::work> pending_;
  std::vector<int> release_;
  int fetched_ = -1;  // the last microbatch fetched
  microbatch_data data_;
  double loss_sum_ = 0;
  owned_tensor tied_recv_;
  pipeline_timing timing_;
};

}  // namespace troupe::models::parallel
