// hybrid_trainer: one rank's part of a dp x pp x tp (or dp x cp x pp) training run, composed from
// the pieces of models/parallel: the rank's model piece (the whole model, a tensor-parallel shard,
// a pipeline stage, or a shard of a stage) as a grad_producer, driven by the data-parallel engine
// (dp_trainer: gradient buckets, ZeRO, clipping over the model-parallel group, AdamW). With
// parallel.ep > 1 (an MoE model) the piece is the rank's experts and everything else, trained by
// ep_trainer (expert_parallel.hpp) over the dp, ep and edp groups instead.
//
// Every rank of the job builds one with the same train_config and its own communicators (over UCX
// in a launched job, over threads in tests); step() is collective over all of them. The update
// equals the single-process trainer's (models/trainer.hpp) at the same tokens per step.
//
// A rank holds its piece, never the whole model: the whole model is a description (whole_model.hpp:
// names, shapes, the flat layout), and its weights pass one parameter at a time - drawn by the
// single-process init, or read from a checkpoint's mapped files - into the piece, whatever plan
// wrote them. save() writes the folder the single-process trainer writes (weights in HF layout,
// config.json, optimizer.safetensors with the moments in its layout, trainer_state.json), gathered
// parameter by parameter (weights) and in windows (moments) straight into the files, so with
// checkpoint.resume a run continues under any plan, or in one process, exactly where it stopped
// (plan_checkpoint.hpp). Scratch beyond the piece: about one whole parameter, or one window.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "collective/communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/config.hpp"
#include "models/parallel/grad_producer.hpp"
#include "models/parallel/reshard.hpp"
#include "models/train_config.hpp"
#include "models/trainer.hpp"

namespace troupe::models::parallel {

// This rank's groups (not owned). Each must be given, of size 1 when the degree is 1.
struct hybrid_groups {
  collective::communicator* dp = nullptr;  // ranks with this rank's pp and tp coordinates
  collective::communicator* pp = nullptr;  // the stages of this rank's pipeline, in stage order
  collective::communicator* tp = nullptr;  // the tensor shards of this rank's stage
  collective::communicator* mp = nullptr;  // pp x tp: this data-parallel replica's ranks
  // Context parallelism (parallel.cp > 1 only; context_parallel.hpp): the ranks that share this
  // rank's samples, in sequence order, and dp x cp (cp fastest), the engine's group then.
  collective::communicator* cp = nullptr;
  collective::communicator* dp_cp = nullptr;
  // Expert parallelism (parallel.ep > 1 only; expert_parallel.hpp): this rank's expert-parallel
  // group (ep consecutive dp ranks) and expert-data-parallel group (the dp / ep ranks holding the
  // same experts).
  collective::communicator* ep = nullptr;
  collective::communicator* edp = nullptr;
};

struct ep_step_load;
struct dp_bucket;

class hybrid_trainer {
 public:
  // cfg.plan gives the degrees (their product is the world size), ZeRO stage, microbatches and
  // schedule; it is validated against the model first (errors name the "parallel.<key>"). The
  // weights: this rank's part of the HF weights of cfg.model_hf when given, else the
  // single-process model's init_weights(cfg.seed). With cfg.resume (a folder written by save() or
  // by the single-process trainer) the weights, AdamW's moments and the step count come from there
  // instead: every rank reads its own parts, checked before anything is kept; errors name the file
  // and the tensor or setting. A folder saved at or past cfg.steps, or by a run with another seed,
  // data or batch layout, is refused on every rank (run_state.hpp: check_steps_left,
  // check_data_position).
  hybrid_trainer(const hf::model_config& model, const train_config& cfg, const hybrid_groups& g);
  ~hybrid_trainer();
  hybrid_trainer(const hybrid_trainer&) = delete;
  hybrid_trainer& operator=(const hybrid_trainer&) = delete;

  step_result step(const trainer::batch_source& data);
  // A post-training step (models/post/plan_samples.hpp): microbatches from `samples` with their
  // packing, weights and per-token objective, computed where the logits are. Not with
  // parallel.ep or parallel.cp > 1.
  step_result step(const sample_source& samples);
  std::int64_t steps_done() const;

  // Elastic runs (actors/training.hpp): step() in two phases, committed only once every rank of
  // the job prepared the step (dp_trainer::prepare / commit; every stage commits without a
  // collective: zero 1 and 2 all-gather the updated parameters at the start of the next step,
  // dp_options::defer_gather).
  void prepare(const trainer::batch_source& data);
  step_result commit();
  void discard_prepared();
  // This rank's piece state as views of its own buffers (writing them changes the state): the flat
  // f32 parameters (bf16: the master weights) and AdamW's m and v of the whole piece (zero 0), or
  // of this rank's ZeRO shard (zero 1-3: dp_trainer::shard_parameters, its chunk of every bucket;
  // in an elastic run every rank of the dp group asks between the same two steps, since the next
  // step then gathers the parameters from the shards), and the counts. set_progress sets the
  // counts (a restored piece).
  struct piece_state {
    tensor params, m, v;
    std::int64_t steps = 0, optimizer_steps = 0;
    bool whole_optimizer = false;  // m and v cover every parameter of the piece (zero 0)
  };
  piece_state state();
  void set_progress(std::int64_t steps_done, std::int64_t optimizer_steps);
  // ZeRO 1-3: the buckets of the data-parallel engine (data_parallel.hpp: bucket b's chunk of dp
  // rank d is elements [b.begin + d * b.chunk, ...) of the whole piece, at b.shard_offset of the
  // shard), for resharding a piece's state onto another dp size (an elastic shrink).
  const std::vector<dp_bucket>& shard_buckets() const;
  // After a failed step whose communicators the caller replaced with new ones (new group ids): the
  // pipeline stage takes steps again (pipeline_runner::revive) and a prepared step is dropped.
  void revive();

  // Collective over every rank of the job: writes `folder` atomically from the rank that is rank
  // 0 of its dp and mp groups, and returns it there ("" elsewhere). The writer streams the files
  // into `<folder>.partial` and puts it in place at the end (hf::stage_folder, publish_folder).
  // When any rank fails (a check, an allocation, the writer's full disk) every rank throws and
  // none waits (the failed one its error, the others naming the folder); the partial folder is
  // removed and `folder` left as it was.
  std::string save(const std::filesystem::path& folder);
  // Collective over every rank of the job: the whole model's f32 parameters (laid out like
  // whole(): the single-process model's params()) into `to` on the rank that is rank 0 of its dp
  // and mp groups, which returns true; elsewhere `to` is not touched (it may be undefined). One
  // parameter at a time, summed over mp (and over dp under ep x pp, where each dp rank holds
  // other experts) from the parts the ranks own (as save() gathers the weights); an RL trainer
  // under a plan sends them to its rollout actors.
  bool gather_parameters(const tensor& to);

  // AdamW's moments in the whole layout (the single-process trainer's flat m and v, laid out like
  // its params(): whole_layout): gathered into m and v on the rank that is rank 0 of its dp and mp
  // groups (collective over every rank; elsewhere m and v are not touched), or this rank's parts of
  // them taken into its optimizer state (local).
  void gather_moments(const whole_layout& whole, const tensor& m, const tensor& v);
  void scatter_moments(const whole_layout& whole, const tensor& m, const tensor& v);
  std::int64_t optimizer_steps() const;  // AdamW updates applied
  // trainer_state.json's "extra": the run (run_extra_json) and, for f16, the loss scaler's state.
  std::string extra_json() const;
  // With memory tiers (train_config::tiers()): the paged optimizer state's line, e.g. "optimizer
  // state in tiers: nvme 3.3 MiB, host 2.0 MiB in slots; NVMe read 26.2 MiB write 26.2 MiB"
  // (paged_moments.hpp); "" without.
  std::string moment_tiers_line();

  const hf::model_config& model_config() const { return model_; }
  const whole_layout& whole() const;    // the whole model's parameters (names, shapes, places)
  std::int64_t parameters() const;      // this rank's parameter elements
  std::string describe() const;         // "stage 1 of 2 (blocks 2-3), tensor shard 0 of 2"
  double last_bubble_fraction() const;  // pipeline idle share of the last step (0 without pp)
  double last_comm_wait_seconds() const;
  // parallel.ep > 1: the last step's expert load of this rank's experts (ep_trainer::last_load);
  // nullptr otherwise.
  const ep_step_load* last_expert_load() const;

 private:
  struct impl;
  void resume(const std::filesystem::path& folder, const whole_layout& whole);
  std::unique_ptr<impl> impl_;
  hf::model_config model_;
};

// A whole model for `model` (f32, host) with its memory, for code that needs all its weights at
// once (tests comparing weights, generating from a checkpoint); training never builds one.
std::unique_ptr<causal_lm> make_whole_model(const hf::model_config& model, std::int64_t seq);

}  // namespace troupe::models::parallel
