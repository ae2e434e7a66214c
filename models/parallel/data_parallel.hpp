// dp_trainer: data-parallel training with ZeRO stages 0, 1 and 2 over one communicator (the dp
// group). Every rank holds the whole model; the update equals the single-process trainer's
// (models/trainer.hpp) at the same tokens per step.
//
// A step reads the same train.batch x train.grad_accum samples a single process reads (sample i of
// step s is row i mod batch of draw s * grad_accum + i / batch), split over the group by
// scheduler::microbatch_plan (plan.dp ranks x plan.microbatches). Each rank runs forward/backward
// on its microbatches with the gradient of each scaled by its weight (slot size / global batch), so
// the sum over the group is the gradient of the step's mean loss.
//
// The flat gradient buffer is cut into buckets of about bucket_bytes, from the end of the buffer
// (the last layers' gradients are final first), each padded to a multiple of dp. Rank r owns the
// r-th 1/dp chunk of every bucket; its "shard" is the union of those chunks.
//   zero 0: each bucket is allreduced; every rank clips and runs AdamW on the whole buffer.
//   zero 1: each bucket is allreduced; each rank keeps AdamW moments only for its shard, updates
//           its shard of the parameters, then the parameters are all-gathered bucket by bucket.
//   zero 2: each bucket is reduce-scattered into a shard-sized gradient buffer (the model's own
//           full gradient buffer still exists: backward writes it); the global norm is the
//           allreduced sum of the shards' squares; then as zero 1.
// Overlap: when the model has a per-block point where a block's gradients are final
// (causal_lm::set_block_grads_hook), a bucket's op is issued during the last microbatch's backward
// as soon as every parameter it holds is final; the rest right after backward. All are waited
// before the optimizer. f32 models only (no mixed precision yet).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "collective/communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/optim.hpp"
#include "models/train_config.hpp"
#include "models/trainer.hpp"
#include "scheduler/microbatch.hpp"

namespace troupe::models::parallel {

struct dp_options {
  std::size_t bucket_bytes = 25u << 20;  // gradient bucket size (rounded up to dp elements)
  bool overlap = true;                   // issue buckets during backward when the model allows it
};

// One bucket of the flat buffers: [begin, begin + length) with chunk = ceil(length / dp) elements
// per rank (the last rank's chunk may be short or empty: padding).
struct dp_bucket {
  std::int64_t begin = 0, length = 0, chunk = 0;
  std::int64_t shard_offset = 0;  // where this bucket's chunk starts in a rank's shard buffer
  std::int64_t ready = 0;         // the backward event after which all its gradients are final
  bool padded(int dp) const { return chunk * dp != length; }
};

// The buckets of a flat buffer of n elements, last elements first.
std::vector<dp_bucket> make_buckets(std::int64_t n, int dp, std::int64_t bucket_elems);

class dp_trainer {
 public:
  // cfg.plan.dp must equal comm.size() and cfg.plan.zero be 0, 1 or 2; the model's weights must be
  // the same on every rank (initialize with the same seed, or load the same checkpoint) and its
  // batch dims hold the largest microbatch (microbatch_rows()).
  dp_trainer(causal_lm& model, const train_config& cfg, collective::communicator& comm,
             const dp_options& opts = {});
  ~dp_trainer();

  step_result step(const trainer::batch_source& data);
  std::int64_t steps_done() const { return step_; }
  const std::vector<dp_bucket>& buckets() const { return buckets_; }
  // Elements of AdamW state (m or v) this rank holds: the whole buffer for zero 0, its shard else.
  std::int64_t optimizer_elements() const;
  // Rows in the largest microbatch of any rank: the batch the model must be planned for.
  static std::int64_t microbatch_rows(const train_config& cfg);

  // Seconds of the last step spent waiting for the gradient and parameter collectives (after
  // backward: what overlap did not hide).
  double last_comm_wait_seconds() const { return comm_wait_; }
  // True when bucket ops start during backward; how many did in the last step.
  bool overlapped() const { return overlap_; }
  std::int64_t buckets_issued_in_backward() const { return early_; }

 private:
  struct shard_optimizer;
  void read_rows(std::int64_t begin, std::int64_t end, const trainer::batch_source& data);
  void issue_ready(std::int64_t event);  // issues the buckets whose `ready` is event
  void issue_bucket(const dp_bucket& b);
  double reduce_gradients();  // waits; returns the global norm before clipping (then clips)
  void gather_parameters();

  causal_lm& model_;
  train_config cfg_;
  collective::communicator& comm_;
  dp_options opts_;
  scheduler::microbatch_plan plan_;
  std::vector<dp_bucket> buckets_;
  std::unique_ptr<adamw_optimizer> full_opt_;   // zero 0
  std::unique_ptr<shard_optimizer> shard_opt_;  // zero 1 and 2
  owned_tensor shard_grads_;                    // zero 2: this rank's reduced gradient chunks
  owned_tensor shard_params_;      // zero 1, 2: this rank's updated chunks, sent by all_gather
  owned_tensor pad_in_, pad_out_;  // staging for the padded bucket
  std::int64_t step_ = 0;
  double comm_wait_ = 0;
  bool overlap_ = false;
  std::int64_t early_ = 0;
  bool issuing_ = false;                 // the last microbatch's backward is running
  std::int64_t blocks_ = 0;              // events: block blocks_-1-e for e < blocks_, then the end
  std::vector<collective::work> works_;  // the bucket ops of this step
  std::vector<std::int32_t> rows_, draw_rows_, targets_;
  std::uint64_t cached_draw_ = ~std::uint64_t{0};
};

}  // namespace troupe::models::parallel
