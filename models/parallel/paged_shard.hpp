// paged_shard: a ZeRO 3 rank's whole persistent state - its shard of the f32 master parameters, of
// the reduced gradients and AdamW's moments m and v - in the chunks of one memory::tier_manager,
// homed on the host or on NVMe and paged in when the data-parallel engine (dp_trainer,
// data_parallel.hpp) needs them: the memory tiers as a placement of the engine
// (dp_options::moments with dp_options::page_shard), not a trainer of their own.
//
// The shard (a rank's chunks of the dp buckets, bucket i's at buckets[i].shard_offset) is cut into
// SEGMENTS of whole buckets, consecutive in the shard, of about segment_bytes (a bucket larger than
// that is a segment of its own): a collective reads or writes one bucket's chunk at one address, so
// a bucket never straddles two segments. Segment s is four chunks: parameters (id 4s), gradients
// (4s + 1), m (4s + 2) and v (4s + 3), all in shard coordinates (the bucket padding included).
//   - A bucket's parameter all-gather pins its parameter segment from issue to wait
//     (param_gather.hpp, through shard_pins); the gathered full parameters are the piece's buffer.
//   - A bucket's reduce-scatter pins its gradient segment from issue until it has landed (and, with
//     several microbatches, been added into the shard). The first use of a gradient segment in a
//     step fetches nothing (discard): every bucket's first reduction of the step overwrites its
//     chunk.
//   - The update (and the norm before it) is one pass over the segments in order.
// Pins nest: a segment holding several buckets is acquired once per bucket use, so the sequence of
// acquires is the sequence of issues, the same every step. The first step's sequence is recorded
// and becomes the tier manager's schedule from the second step on (Belady eviction and prefetch
// along it: blocks forward, backward in reverse, then the update). Off-step uses (checkpoints,
// gathering everything) rewind it. The host pool must hold every segment pinned at once (the
// update's 4, the gathers and reductions in flight); an acquire that finds every slot pinned
// fails naming memory.host (--host-memory).
//
// Bit for bit: the engine's kernels run on the same values in the same order - AdamW, the clip
// scale and the accumulation are elementwise, and the gradient norm repeats ops::sum_squares's
// fixed chunking (partials of at most 32768 elements, added in order; exact while a norm range
// holds at most 256 x 32768 elements per rank, beyond that the partials are split once more and
// the norm may differ from the run without tiers in its last bits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include "memory/tier_manager.hpp"
#include "models/parallel/paged_moments.hpp"
#include "models/parallel/param_gather.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::parallel {

struct dp_bucket;

class paged_shard final : public shard_pins {
 public:
  enum part : int { params = 0, grads = 1, moment_m = 2, moment_v = 3 };

  // buckets: the dp buckets (listed in shard order); must outlive this.
  paged_shard(const std::vector<dp_bucket>& buckets, const moment_tiers& opt);

  std::int64_t elements() const { return elements_; }  // the shard, padding included
  std::int32_t segments() const { return static_cast<std::int32_t>(segs_.size()); }
  // Segment s: [begin, begin + length) of the shard.
  std::pair<std::int64_t, std::int64_t> segment(std::int32_t s) const { return segs_[s]; }

  // Around a step: begin_step rewinds the schedule (and records the first step's uses),
  // end_step after the update (the record becomes the schedule), abandon_step when it failed.
  void begin_step();
  void end_step();
  void abandon_step();

  // shard_pins: bucket i's parameter chunk, pinned until unpin_params (not written).
  const float* pin_params(std::size_t bucket) override;
  void unpin_params(std::size_t bucket) override;
  // Bucket i's gradient chunk, pinned until unpin_grads; written.
  float* pin_grads(std::size_t bucket);
  void unpin_grads(std::size_t bucket);

  // One pass over the segments in order: f(first, views) with the parts listed pinned (f32 [n]
  // views of [first, first + n) of the shard; the others undefined), valid during the call.
  // write: f changed them (written back when evicted). discard: f overwrites every element, so
  // nothing is fetched.
  using segment_fn = std::function<void(std::int64_t first, const tensor (&views)[4])>;
  void for_each(std::initializer_list<part> parts, const segment_fn& f, bool write,
                bool discard = false);
  // The sum of squares of the gradients over [begin, begin + length) of the shard, as
  // ops::sum_squares of a contiguous tensor holding them computes it (see the top).
  double grad_sum_squares(std::int64_t begin, std::int64_t length);
  // After an off-step pass (checkpoints): back to the schedule's start.
  void rewind() { tiers_.rewind(); }

  memory::tier_manager& tiers() { return tiers_; }

 private:
  std::byte* acquire(std::int32_t chunk, bool discard);
  void release(std::int32_t chunk, bool dirty);

  const std::vector<dp_bucket>& buckets_;
  std::int64_t elements_ = 0;
  std::vector<std::pair<std::int64_t, std::int64_t>> segs_;  // [begin, length)
  std::vector<std::int32_t> seg_of_;                         // per bucket
  std::vector<char> grads_touched_;  // per segment: its gradients were acquired this step
  memory::tier_manager tiers_;
  bool scheduled_ = false, recording_ = false;
  std::vector<memory::chunk_use> record_;
  std::vector<float> scratch_;  // a norm partial that straddles two segments
  std::vector<int> pins_;       // per chunk: acquires not released yet
  std::size_t pinned_ = 0;      // chunks with pins
  std::size_t host_bytes_ = 0;
};

}  // namespace troupe::models::parallel
