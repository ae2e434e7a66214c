// dp_trainer: data-parallel training with ZeRO stages 0 to 3 over one communicator (the dp
// group), around any grad_producer (grad_producer.hpp): a whole model (model_producer.hpp), a
// tensor-parallel shard, a pipeline stage. The update equals the single-process trainer's
// (models/trainer.hpp) at the same tokens per step.
//
// A step reads the same train.batch x train.grad_accum samples a single process reads (sample i of
// step s is row i mod batch of draw s * grad_accum + i / batch), split over the group by
// scheduler::microbatch_plan (plan.dp ranks x plan.microbatches). The engine hands this rank's
// microbatches to piece.forward_backward through its fetch callback, each with its weight (slot
// size / global batch), so the sum over the group is the gradient of the step's mean loss.
//
// The flat buffers are cut into groups: one per block (its parameters "<scope>.<i>.*" are one
// range, layer_memory laying them out in declaration order) and one for everything else, whose
// ranges are cut at each parameter (so a tied embedding held by two pipeline stages is bucketed,
// and summed, the same way on both); each range into buckets of about bucket_bytes from its end
// (the last layers' gradients are final first), each padded to a multiple of dp (a remainder that
// is not is split into its unpadded part and a tail of fewer than dp elements). Rank r owns the
// r-th 1/dp chunk of every bucket; its "shard" is the union of those chunks.
//   zero 0: each bucket is allreduced; every rank clips and runs AdamW on the whole buffer.
//   zero 1: each bucket is allreduced; each rank keeps AdamW moments only for its shard, updates
//           its shard of the parameters, then the parameters are all-gathered bucket by bucket.
//   zero 2: each bucket is reduce-scattered into a shard-sized gradient buffer; the global norm
//           is the allreduced sum of the shards' squares; then as zero 1. The piece's full-size
//           gradient buffer (backward writes it) holds only what is not reduced yet: with the
//           piece's grads hook (below) and dp_options::release_grads, a bucket's pages are given
//           back (layer_memory::release_grads: they read as zeros, which replaces zeroing the
//           buffer) as soon as its reduce-scatter has consumed them, and at most
//           grads_in_flight_bytes of buckets are in flight. With the microbatch hook
//           (grad_producer::set_microbatch_grads_hook: a model_producer of a gpt or llama) the
//           block buckets are reduce-scattered after every microbatch's backward through their
//           blocks and added into the shard (the first one lands in it directly, later ones go
//           through a staging ring of about grads_in_flight_bytes / dp), so a rank holds its
//           shard, the gradients outside the blocks (embeddings, final norm, head: reduced once
//           after forward_backward, so a tied embedding written at both ends of the model is
//           complete), the block whose backward runs and the buckets in flight. With only the
//           final-gradients hook (a pipeline_runner) buckets go during the last microbatch's
//           backward (or weight action, where the schedule splits backwards) and are released
//           when reduced; without either hook (or with release_grads
//           off) the whole buffer stays resident, zeroed each step.
//   zero 3: as zero 2 (gradients included), and the rank's f32 parameters live in its shard (the
//           master copy, updated by AdamW there). The piece's buffer is a full-size range whose
//           pages are given back when released (param_gather.hpp): the group outside the blocks
//           is all-gathered at the start of the step, each block's right before its forward and
//           again before its backward (the next dp_options::prefetch blocks' gathers issued while
//           it computes), released after each use; so at most the outside group and prefetch + 1
//           blocks are gathered at once. A piece without the block use hook (grad_producer.hpp)
//           gets every bucket before forward_backward instead. After the step nothing is
//           gathered; with dp_options::poison_released released ranges are filled with NaN
//           instead of given back, so any parameter a step used without gathering it turns the
//           loss into NaN. The caller rejects zero 3 with pipeline parallelism (pp > 1).
// Gradient norm (clipping): the sum of squares of the gradients of the parameters the piece
// counts (counts_in_norm), summed over the dp shards (zero 2, 3) and over piece.norm_group().
// Overlap: when the piece calls its block hook (grad_producer::set_block_grads_hook), a bucket's
// op is issued from the hook as soon as every block it holds is final; the rest right after
// forward_backward (the hook must run on the thread that called forward_backward). All are waited
// before the optimizer. A step that throws (and the destructor) first waits for the ops it issued,
// ignoring their results: the next step starts over (the gradient buffer zeroed). Every rank of
// the group must then fail at the same point, or the group be aborted, else that wait blocks.
// f32 host pieces (a bf16 model goes through mixed_piece.hpp, which presents its f32 master
// weights).
// Memory tiers (dp_options::moments, ZeRO 1-3): the shard's AdamW moments live in a tier
// manager's chunks on the host or NVMe and are paged in segment by segment for the update
// (paged_moments.hpp); the update's arithmetic is the same, bit for bit. Under ZeRO 3 (with
// dp_options::page_shard) the shard's f32 master parameters and reduced gradients live in the same
// tier manager's chunks, with the moments (paged_shard.hpp): a bucket's parameter chunk is pinned
// while its all-gather is in flight, its gradient chunk while its reduce-scatter lands (and is
// added), and everything segment by segment for the norm and the update; the engine then holds no
// shard-sized buffer of its own. Losses, norms, weights and moments stay the same, bit for bit.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "collective/communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/loss_scaler.hpp"
#include "models/optim.hpp"
#include "models/parallel/grad_producer.hpp"
#include "models/parallel/paged_moments.hpp"
#include "models/parallel/paged_shard.hpp"
#include "models/parallel/param_gather.hpp"
#include "models/train_config.hpp"
#include "models/trainer.hpp"
#include "scheduler/microbatch.hpp"

namespace troupe::models::parallel {

struct dp_options {
  std::size_t bucket_bytes = 25u << 20;  // gradient bucket size (rounded up to dp elements)
  bool overlap = true;                   // issue buckets during backward when the piece allows it
  // ZeRO 3 debug check: fill released parameter ranges with NaN (instead of giving their pages
  // back), so the loss turns NaN if the piece reads a parameter that was not gathered.
  bool poison_released = false;
  // ZeRO 3: how many blocks' gathers are issued ahead of the block in use (0: each block is
  // gathered when its use begins).
  int prefetch = 1;
  // ZeRO 3: sample the resident bytes of the parameter buffer (mincore) at every block use, for
  // peak_resident_param_bytes(); all stages: the gradient buffer's at every grads hook call and
  // after forward_backward, for peak_resident_grad_bytes().
  bool measure_resident = false;
  // ZeRO 2, 3 with the piece's grads hook: give a bucket's gradient pages back once it is reduced
  // (off: the full gradient buffer stays resident and is zeroed every step).
  bool release_grads = true;
  // With release_grads: at most this many bucket bytes issued and not reduced yet; a bucket that
  // would exceed it first waits for the oldest (back-pressure: a rank running ahead of the group
  // holds no more than this). 0: 2 x bucket_bytes. One bucket may always be in flight.
  std::size_t grads_in_flight_bytes = 0;
  // ZeRO 1-3: the shard's AdamW moments in memory tiers (paged_moments.hpp); none: in memory.
  std::optional<moment_tiers> moments = std::nullopt;
  // ZeRO 3 with `moments`: the shard's parameters and gradients in the same tiers (off: only the
  // moments are paged, as under ZeRO 1 and 2).
  bool page_shard = true;
  // ZeRO 1, 2: commit updates this rank's shard of the parameters only (local, no collective)
  // and the all-gather runs at the start of the next prepare (or in gather_full_parameters), so
  // the optimizer step is a commit point that cannot fail on a live rank (elastic runs,
  // actors/training.hpp). The numbers are the same, bit for bit.
  bool defer_gather = false;
  // Expert parallelism over a pipeline stage (hybrid.hpp): the expert parameters
  // (param_spec::expert >= 0) are this rank's experts, which the other ranks of its expert-parallel
  // group do not hold (the expert exchange brought their tokens here): their buckets are reduced
  // over expert_dp (the dp ranks holding the same experts; with ep = dp this rank alone, and they
  // are not reduced) instead of the dp group, and their squares in the global norm are summed over
  // expert_group (the ep group). ZeRO 0 only; both groups must be given.
  bool own_experts = false;
  collective::communicator* expert_dp = nullptr;
  collective::communicator* expert_group = nullptr;

  // The defaults with the plan's settings: bucket_bytes from parallel.dp_bucket_bytes, overlap
  // from parallel.dp_overlap.
  static dp_options of(const scheduler::parallel_plan& plan);
};

// One bucket of the flat buffers: [begin, begin + length) with chunk = ceil(length / dp) elements
// per rank (the last rank's chunk may be short or empty: padding).
struct dp_bucket {
  std::int64_t begin = 0, length = 0, chunk = 0;
  std::int64_t shard_offset = 0;  // where this bucket's chunk starts in a rank's shard buffer
  // With overlap: the lowest block whose parameters it holds (it is issued once all of its
  // blocks' hooks fired); -1: issued after forward_backward (it holds a parameter outside the
  // blocks, or only padding, or the piece has no block hook).
  std::int64_t ready = -1;
  bool padded(int dp) const { return chunk * dp != length; }
};

// The buckets of a flat buffer of n elements, last elements first.
std::vector<dp_bucket> make_buckets(std::int64_t n, int dp, std::int64_t bucket_elems);
// The buckets of a flat buffer tiled by `ranges` ([begin, length), ascending and adjacent): each
// range cut as above (a padded remainder split into its unpadded part and a tail of fewer than dp
// elements), last ranges first.
std::vector<dp_bucket> make_buckets(
    const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges, int dp,
    std::int64_t bucket_elems);

class dp_trainer {
 public:
  // cfg.plan.dp x cfg.plan.cp must equal dp.size() and cfg.plan.zero be 0 to 3 (with context
  // parallelism the group is dp x cp, cp fastest: rank r reads data-parallel rank r / cp's rows,
  // the piece keeps its part of the sequence and its gradients are reduced, and ZeRO sharded, over
  // the whole group: context_parallel.hpp); the piece's weights must be
  // the same on every dp rank (initialize with the same seed, or load the same checkpoint) and
  // its batch dims hold the largest microbatch (microbatch_rows()). The piece must outlive the
  // trainer.
  dp_trainer(grad_producer& piece, const train_config& cfg, collective::communicator& dp,
             const dp_options& opts = {});
  // A whole model, wrapped in a model_producer.
  dp_trainer(causal_lm& model, const train_config& cfg, collective::communicator& comm,
             const dp_options& opts = {});
  ~dp_trainer();
  dp_trainer(const dp_trainer&) = delete;
  dp_trainer& operator=(const dp_trainer&) = delete;

  step_result step(const trainer::batch_source& data);
  // A step whose microbatches a post-training source makes (grad_producer.hpp: sample_source):
  // its rows, packing, weights and per-token objective. Not with context parallelism.
  step_result step(const sample_source& samples);
  // step() in two phases, for a caller that commits a step only once every rank of the job has
  // prepared it (actors/training.hpp, elastic runs: the optimizer step is the commit point).
  // prepare runs forward, backward and every gradient collective and clips (it may throw: nothing
  // is applied then); commit applies AdamW (zero 0 and 3, and 1 and 2 with
  // dp_options::defer_gather: local, no collective) and returns the step's result; discard_prepared
  // drops a prepared step (its gradients are zeroed next step).
  void prepare(const trainer::batch_source& data);
  step_result commit();
  void discard_prepared();
  bool prepared() const { return prepared_; }
  std::int64_t steps_done() const { return step_; }
  const std::vector<dp_bucket>& buckets() const { return buckets_; }
  // Elements of AdamW state (m or v) this rank holds: the whole buffer for zero 0, its shard else.
  std::int64_t optimizer_elements() const;
  // Rows in the largest microbatch of any rank: the batch the model must be planned for.
  static std::int64_t microbatch_rows(const train_config& cfg);
  // Checkpoints: the AdamW state this rank holds. m and v are views of the optimizer's own
  // buffers (writing them changes the state; with dp_options::moments, of a copy the call makes
  // of the paged moments, written back by the next step); run i of them, [state, state + length),
  // belongs to [flat, flat + length) of the piece's flat parameter buffer. `whole`: zero 0, every
  // dp rank holds the state of the whole buffer; else the runs are this rank's ZeRO shard.
  struct optimizer_run {
    std::int64_t flat = 0, state = 0, length = 0;
  };
  struct optimizer_view {
    tensor m, v;
    std::vector<optimizer_run> runs;
    std::int64_t steps = 0;  // AdamW updates applied
    bool whole = false;
  };
  optimizer_view optimizer_state() const;
  // Resuming: the steps done (the data position and the learning-rate schedule) and AdamW's update
  // count (its bias correction).
  void set_progress(std::int64_t steps_done, std::int64_t optimizer_steps);
  // f16 (a piece that scales its loss: mixed_piece.hpp): the dynamic loss scale. Before each
  // forward_backward the piece gets scale x train.grad_accum (mixed_piece.hpp); after it, one flag
  // is summed over the dp group and the piece's norm group (together the whole grid: dp x pp x tp,
  // or dp x cp), so a non-finite gradient on any rank, in any parameter (counted in the norm or
  // not, in any rank's ZeRO chunk), skips the step on every rank: no clipping, no update, the
  // gradient norm reported as 0 and the scale halved, as in the single process
  // (models/trainer.hpp). Null for f32 and bf16. Checkpoints save and resume it (hybrid.hpp).
  loss_scaler* scaler() { return scaler_ ? &*scaler_ : nullptr; }
  // Zero 3: all-gathers the current parameters into the piece's buffer (collective over the dp
  // group: every rank calls it), e.g. before evaluating or saving; zero 1, 2 with defer_gather:
  // the same when a commit or shard_parameters() left the buffer behind the shards. Zero 0 and
  // zero 1, 2 without defer_gather: nothing to do.
  void gather_full_parameters();
  // ZeRO 1-3 (not paged): this rank's shard of the parameters - its chunk of every bucket, in
  // shard order, the padding zero; zero 3: the master copy - as a view of the engine's buffer
  // (writing it changes the state). Zero 1, 2: staged from the piece's buffer when that is current;
  // with defer_gather the shard is then the parameters' copy of record, and the next prepare (or
  // gather_full_parameters) all-gathers every rank's, so every rank of the dp group calls this
  // between the same two steps (elastic replication and recovery ask every rank). Zero 0 or paged:
  // an undefined tensor.
  tensor shard_parameters();

  // Parameter bytes the engine held gathered at most since the last step began (zero 3: the outside
  // group and the blocks in use or prefetched, in-flight gathers included; else the whole buffer);
  // with dp_options::measure_resident, the parameter buffer's resident bytes at most (mincore;
  // zero 3 samples at every block use, else after forward_backward).
  std::int64_t peak_gathered_bytes() const;
  std::size_t peak_resident_param_bytes() const;
  // Gradients (last step): whether buckets are given back after their reduce-scatter; the bytes of
  // the reduced shard buffers (the shard, and the accumulation staging with several microbatches);
  // the bucket bytes issued but not reduced yet at most; with measure_resident, the full-size
  // gradient buffer's resident bytes at most (mincore).
  bool releases_grads() const { return release_; }
  std::int64_t reduced_grad_bytes() const;
  std::int64_t peak_grads_in_flight_bytes() const { return in_flight_peak_ * 4; }
  std::size_t peak_resident_grad_bytes() const { return grad_resident_peak_; }

  // Seconds of the last step spent waiting for the gradient and parameter collectives (after
  // backward: what overlap did not hide; zero 3: and the parameter gathers before forward).
  double last_comm_wait_seconds() const { return comm_wait_; }
  // True when bucket ops start during backward; how many did in the last step.
  bool overlapped() const { return overlap_; }
  // dp_options::moments: the moments' tier manager (its report: bytes per tier, NVMe traffic).
  memory::tier_manager* moment_tiers_manager();
  std::int64_t buckets_issued_in_backward() const { return early_; }

 private:
  struct shard_optimizer;
  // piece: the producer to drive, or null for `owned`.
  dp_trainer(std::unique_ptr<grad_producer> owned, grad_producer* piece, const train_config& cfg,
             collective::communicator& dp, const dp_options& opts);
  void read_rows(std::int64_t begin, std::int64_t end, const trainer::batch_source& data);
  microbatch_data fetch(int k, const trainer::batch_source& data);
  void on_block(std::int64_t block);              // the piece's final-gradients hook
  void on_microbatch(int k, std::int64_t block);  // its microbatch grads hook
  void issue_ready();                             // the buckets whose blocks are all final
  void issue_bucket(std::size_t i);
  struct pending_op {
    std::size_t bucket = 0;
    collective::work work;
    std::int64_t at = -1;    // >= 0: reduced into shard_in_ there, added into the shard when done
    float* grads = nullptr;  // paged shard: the bucket's gradient chunk, pinned until done
  };
  // Waits for the oldest op, takes it off pending_, then accumulates and releases its bucket (an
  // op whose wait throws is left pending, for abandon_pending).
  void finish_oldest();
  void poll();  // finishes the ops that are done, oldest first, keeps the rest
  void wait_pending();
  void wait_oldest();
  // A failed step (or the destructor): waits for every op in flight (they read the gradient buffer
  // and pad_in_ and write shard_grads_ and shard_in_), ignoring their errors, without adding
  // anything, and forgets them.
  void abandon_pending() noexcept;
  std::int64_t staging_for(std::int64_t chunk);  // a place in shard_in_ (waits while full)
  // Gives bucket i's range back, with the parts of its edge pages that released neighbours hold
  // (so a page two buckets share goes when both are released).
  void release_run(std::size_t i);
  void sample_grads();
  double reduce_gradients();   // waits; returns the global norm before clipping (then clips)
  bool any_rank_overflowed();  // f16: whether any rank of the grid has a non-finite gradient
  double sum_squares(const tensor& t,
                     const std::vector<std::pair<std::int64_t, std::int64_t>>& ranges) const;
  void gather_parameters();  // zero 1, 2: all-gathers the updated chunks
  void stage_shard();  // zero 1, 2: this rank's chunks of the piece's buffer into shard_params_
  void on_use(std::int64_t block, block_use use);  // the piece's block use hook (zero 3)

  std::unique_ptr<grad_producer> owned_;  // the model_producer of the causal_lm constructor
  grad_producer& piece_;
  train_config cfg_;
  collective::communicator& comm_;
  dp_options opts_;
  scheduler::microbatch_plan plan_;
  std::vector<dp_bucket> buckets_;
  std::vector<std::vector<std::int64_t>> bucket_blocks_;  // overlap: the blocks each bucket holds
  std::vector<char> issued_, final_;                      // per bucket; per block (this step)
  // Flat [begin, length) ranges of the parameters the piece counts in the norm, and the same in
  // shard coordinates (zero 2, 3).
  std::vector<std::pair<std::int64_t, std::int64_t>> norm_ranges_, shard_norm_ranges_;
  // own_experts: the counted expert ranges (norm_ranges_ holds the rest), and per bucket whether
  // it lies in an expert parameter (not reduced).
  std::vector<std::pair<std::int64_t, std::int64_t>> expert_norm_ranges_;
  std::vector<char> own_bucket_;
  std::unique_ptr<adamw_optimizer> full_opt_;   // zero 0
  std::unique_ptr<shard_optimizer> shard_opt_;  // zero 1, 2 and 3
  owned_tensor shard_grads_;                    // zero 2, 3: this rank's reduced gradient chunks
  // zero 1, 2: this rank's updated chunks, sent by all_gather; zero 3: its parameters (master).
  owned_tensor shard_params_;
  owned_tensor pad_in_;                   // staging for the padded buckets' reduce-scatter
  std::vector<std::int64_t> pad_at_;      // per bucket: its staging in pad_in_ (padded only)
  std::unique_ptr<param_gather> params_;  // zero 1, 2, 3: gathers from shard_params_
  // zero 3 with page_shard: the shard in memory tiers (shard_optimizer owns it; shard_params_ and
  // shard_grads_ are then empty), and the clip factor the update applies segment by segment.
  paged_shard* paged_ = nullptr;
  double paged_clip_ = 1.0;
  bool use_hook_ = false;          // zero 3: the piece reports block uses
  std::size_t resident_peak_ = 0;  // zero 0, 1, 2 with measure_resident
  std::int64_t step_ = 0;
  bool prepared_ = false;  // prepare() ran; commit() applies it
  // zero 1, 2 with defer_gather: shard_params_ holds the parameters of record and the piece's
  // buffer is to be all-gathered from the shards before it is read.
  bool gather_due_ = false;
  double prepared_loss_ = 0, prepared_norm_ = 0;
  std::optional<loss_scaler> scaler_;  // f16
  bool prepared_overflow_ = false;     // f16: some rank's gradients were not all finite
  double prepared_scale_ = 1.0;        // f16: the scale the prepared step ran with
  std::chrono::steady_clock::time_point prepared_t0_;
  double comm_wait_ = 0;
  bool overlap_ = false;
  std::int64_t early_ = 0;
  bool running_ = false;  // inside forward_backward: the hook may issue
  int next_fetch_ = 0;
  const sample_source* samples_ = nullptr;  // step(sample_source)'s, during that step
  std::deque<pending_op> pending_;  // the bucket ops of this step not waited yet, oldest first
  bool release_ = false;            // zero 2, 3: buckets are given back once reduced
  bool per_mb_ = false;             // the piece calls the microbatch grads hook
  bool grads_dirty_ = false;        // a step failed: zero the gradient buffer first
  std::vector<char> reduced_;       // per bucket: its shard chunk holds a value this step
  std::vector<char> released_;      // per bucket: its range is given back (this microbatch)
  // A ring of the reductions in flight that are added into the shard (microbatches after the
  // first), about grads_in_flight_bytes / dp.
  owned_tensor shard_in_;
  std::int64_t ring_head_ = 0;
  std::int64_t in_flight_ = 0, in_flight_peak_ = 0;  // elements of buckets issued, not reduced
  std::int64_t in_flight_limit_ = 0;                 // elements (grads_in_flight_bytes)
  std::int64_t page_elements_ = 1024;                // gradient elements per host page
  std::size_t grad_resident_peak_ = 0;
  std::vector<std::int32_t> rows_, draw_rows_, targets_;
  std::uint64_t cached_draw_ = ~std::uint64_t{0};
};

}  // namespace troupe::models::parallel
