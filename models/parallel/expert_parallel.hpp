// expert_parallel: training an MoE model (models/moe.hpp) with its experts split over an
// expert-parallel group, carved out of the data-parallel ranks (scheduler/plan.hpp's convention,
// DeepSpeed's and Colossal-AI's): world = dp ranks, ep divides dp, dp rank d is rank d % ep of the
// expert-parallel group of dp ranks [d / ep * ep, d / ep * ep + ep) and holds experts
// [(d % ep) * n / ep, (d % ep + 1) * n / ep) of every MoE layer; everything else (embeddings,
// attention, norms, routers, shared experts, head) is on every rank.
//
// A step reads the single-process trainer's samples (models/trainer.hpp: draw s * grad_accum + k,
// train.batch rows each) and gives dp rank d rows [d * batch / dp, (d + 1) * batch / dp) of every
// draw; each rank's backward is scaled by 1 / (dp x grad_accum), so the sums below are the
// gradient of the step's mean loss. In forward and backward every MoE layer exchanges token rows
// with its group (models/layers/moe_dispatch.hpp: counts first, then all_to_allv both ways).
// After backward
//   - the non-expert gradients are allreduced over all dp ranks (the dp group),
//   - the expert gradients over the expert-data-parallel group: the dp / ep ranks holding the same
//     experts (d % ep equal), every one of them, every step, over the whole expert range, so an
//     expert no token chose on some rank (a zero gradient there) is still reduced and nothing waits
//     for a rank that skipped it;
//   - the global norm is the non-expert part's plus the expert parts' summed over the ep group
//     (its ranks hold disjoint experts), then clipping as torch's clip_grad_norm_.
// AdamW then runs on this rank's parameters (zero 0), or (zero 1) each rank keeps the moments of
// and updates 1 / n of every range, n its reduction group's size, and the updated chunks are
// all-gathered over that group (the non-expert ranges over dp, the expert ranges over the
// expert-data-parallel group). ZeRO 2: the same chunks, and instead of the allreduce each range's
// gradient is reduce-scattered over its group, so a rank receives only its chunk's sum (half an
// allreduce's traffic); the norm is the chunks' squares summed over dp. The full-size gradient
// buffer stays (backward writes it), so ZeRO 2 saves traffic here, not gradient memory yet.
//
// The per-step expert load (ep_step_load) is returned by last_load(): every expert's routed rows
// over the whole job, this rank's experts' served rows, the imbalance and the dropped choices
// (none: dropless).
//
// troupe train's engine (hybrid.hpp) runs this trainer when parallel.ep > 1, across processes.
// Not here: tensor and pipeline placements of an MoE model, ZeRO 3 (the ep_trainer refuses them
// naming the setting), capacity (dropless only). Experts split over pipeline stages' dp ranks
// (ep x pp) run through dp_trainer instead (moe_stage.hpp, hybrid.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collective/communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/config.hpp"
#include "models/layers/moe_dispatch.hpp"
#include "models/moe.hpp"
#include "models/optim.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/train_config.hpp"
#include "models/trainer.hpp"

namespace troupe::models::parallel {

// moe_exchange over a communicator (the expert-parallel group): counts by all_to_all (i64), rows
// by all_to_allv. Each call waits for its op; a failed op throws its error.
class comm_exchange final : public moe_exchange {
 public:
  explicit comm_exchange(collective::communicator& ep) : ep_(ep) {}
  int size() const override { return ep_.size(); }
  int rank() const override { return ep_.rank(); }
  void counts(const std::vector<std::int64_t>& send, std::vector<std::int64_t>& recv,
              std::int64_t per_peer) override;
  void rows(const tensor& in, const std::vector<std::int64_t>& send_rows, const tensor& out,
            const std::vector<std::int64_t>& recv_rows) override;
  // Seconds spent in the exchanges (issue to completion) since the exchange was made.
  double seconds() const { return seconds_; }

 private:
  collective::communicator& ep_;
  double seconds_ = 0;
};

// The three groups of a rank (group ranks as above): dp (all dp ranks), ep (this rank's
// expert-parallel group: ep consecutive dp ranks) and edp (the dp / ep ranks holding its experts;
// with dp == ep a group of one).
struct ep_groups {
  collective::communicator* dp = nullptr;
  collective::communicator* ep = nullptr;
  collective::communicator* edp = nullptr;
};

// One step's expert load.
struct ep_step_load {
  // Per expert (global index), summed over the layers, microbatches and every dp rank: the rows
  // routed to it (top-k choices). Dropless: all of them are served.
  std::vector<std::int64_t> tokens;
  // Per local expert (first_expert, first_expert + 1, ...): the rows this rank's experts served
  // (from its whole expert-parallel group), summed over the layers and microbatches.
  std::int32_t first_expert = 0;
  std::vector<std::int64_t> served;
  std::int64_t dropped = 0;  // choices over capacity (dropless: 0)
  // This rank's seconds in the MoE layers' all-to-alls during the step's forwards and backwards
  // (waiting for peers included), and the step's seconds up to the gradient reduction.
  double exchange_seconds = 0, compute_seconds = 0;
  // The step's seconds from the gradient reduction's issue until it (the allreduces, or ZeRO 2's
  // reduce-scatters) and the loss and load allreduce completed.
  double reduce_seconds = 0;
  // The most loaded expert's tokens over the mean (1: balanced; at most n_expert / top_k; 0 for a
  // step without tokens).
  double imbalance = 0;
};

// "tokens per expert 130 97 142 143, imbalance 1.12, served here 130 97 (experts 0-1)".
std::string describe(const ep_step_load& l);

class ep_trainer {
 public:
  // An MoE `model` (its HF config) under cfg.plan: plan.ep = g.ep->size(), plan.dp = g.dp->size(),
  // g.edp->size() = dp / ep; tp = pp = 1, zero 0, 1 or 2, one microbatch; f32. Builds this rank's
  // model piece (its experts only); set its weights (init_weights, or load by name) the same on
  // every rank before the first step.
  ep_trainer(const hf::model_config& model, const train_config& cfg, const ep_groups& g);
  ~ep_trainer();
  ep_trainer(const ep_trainer&) = delete;
  ep_trainer& operator=(const ep_trainer&) = delete;

  step_result step(const trainer::batch_source& data);
  causal_lm& model();
  const ep_step_load& last_load() const { return load_; }
  std::int64_t steps_done() const { return step_; }
  // Elements of AdamW state (m or v) this rank holds.
  std::int64_t optimizer_elements() const;

  // Checkpoints (hybrid.hpp's save and resume): this rank's AdamW state in data_parallel's terms.
  // ZeRO 0: the optimizer's own m and v over the whole piece (`whole`); ZeRO 1, 2: a copy of this
  // rank's chunk of every range, run by run (flat coordinates of the piece's buffer).
  // set_moments writes m and v laid out like that view into the state (ZeRO 0: a no-op when they
  // are the view itself); set_progress sets the steps done and AdamW's update count (resuming).
  dp_trainer::optimizer_view optimizer_state();
  void set_moments(const tensor& m, const tensor& v);
  void set_progress(std::int64_t steps_done, std::int64_t optimizer_steps);

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
  ep_step_load load_;
  std::int64_t step_ = 0;
};

// The refusals of a plan for ep_trainer ("" when it can run it), each naming the setting.
std::string ep_plan_problems(const hf::model_config& model, const train_config& cfg);

}  // namespace troupe::models::parallel
