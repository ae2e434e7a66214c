// Microbatch plan: which samples of a step each (data-parallel rank, microbatch) consumes.
//
// A step consumes global_batch samples, numbered in the order a single process would read them
// (sample `step * global_batch + i` is the i-th of the step). They are cut into dp * microbatches
// slots laid out microbatch by microbatch: slot q = microbatch * dp + dp_rank holds the q-th run
// of samples (Megatron's sampler: each microbatch round takes a contiguous block, split over the
// data-parallel ranks). So the slots, read in order, are exactly the single-process batch, and the
// single-process run with batch = slot size and grad_accum = dp * microbatches reads slot q as its
// micro-batch q. When global_batch is not a multiple of the slot count, the first
// global_batch mod (dp * microbatches) slots hold one sample more, and weight() (slot size /
// global batch) is what makes the step's loss the mean over all samples: the gradient of each
// slot's mean loss is scaled by its weight and summed over microbatches and over the dp group.
#pragma once

#include <cstdint>
#include <vector>

namespace troupe::scheduler {

struct sample_range {
  std::int64_t begin = 0, end = 0;  // [begin, end)
  std::int64_t size() const { return end - begin; }
  friend bool operator==(const sample_range&, const sample_range&) = default;
};

class microbatch_plan {
 public:
  // Throws std::invalid_argument unless dp >= 1, microbatches >= 1 and every slot gets a sample
  // (global_batch >= dp * microbatches).
  microbatch_plan(std::int64_t global_batch, int dp, int microbatches);

  std::int64_t global_batch() const { return global_batch_; }
  int dp() const { return dp_; }
  int microbatches() const { return microbatches_; }
  // True when every slot has the same size (what pipeline stages with fixed buffers need).
  bool uniform() const { return global_batch_ % slots() == 0; }
  int slots() const { return dp_ * microbatches_; }
  int slot(int dp_rank, int microbatch) const { return microbatch * dp_ + dp_rank; }

  std::int64_t size(int dp_rank, int microbatch) const;
  // The samples (dp_rank, microbatch) consumes in step `step`, as indices of the sample stream.
  sample_range range(int dp_rank, int microbatch, std::int64_t step = 0) const;
  // The sizes of dp_rank's microbatches, in order, and their sum.
  std::vector<std::int64_t> sizes(int dp_rank) const;
  std::int64_t rank_samples(int dp_rank) const;
  // size / global_batch: the factor on this slot's mean-loss gradient (sum over slots).
  double weight(int dp_rank, int microbatch) const;

 private:
  void check(int dp_rank, int microbatch) const;

  std::int64_t global_batch_;
  int dp_, microbatches_;
};

}  // namespace troupe::scheduler
