// param_gather: which parameters a data-parallel rank holds gathered, for dp_trainer
// (data_parallel.hpp). It all-gathers buckets of the flat parameter buffer from the ranks' shards
// into the piece's buffer and, for ZeRO 3, gives them back after use.
//
// The buffer is cut into groups: one per block (the parameters named "<scope>.<i>.*", one range of
// the flat buffer as layer_memory lays them out in declaration order) and one for everything else
// (embeddings, final norm, head). Every bucket lies inside one group. ZeRO 3 drives it from the
// piece's block use hook (models/block_use.hpp) through a step:
//   begin_step: the outside group is gathered (and waited) and the first window of blocks issued;
//   on_use(i, before_*): the gathers of the next `prefetch` blocks to be used are issued, then
//     block i's are waited;
//   on_use(i, after_*): block i is released unless it is among the next prefetch + 1 uses;
//   end_step: everything is released.
// The blocks are used in the order of the step's microbatches: forward 0..n-1, backward n-1..0,
// per microbatch (checked: another order fails naming the block). At most the outside group and
// prefetch + 1 blocks are gathered at any time. Releasing gives the whole pages inside a group's
// ranges back to the system (layer_memory::release_params; they read as zeros), or with `poison`
// fills the ranges with NaN so a parameter used without a gather turns the loss into NaN.
// All ranks of the group must make the same calls in the same order (they issue collectives).
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "collective/communicator.hpp"
#include "models/block_use.hpp"
#include "models/layers/slots.hpp"

namespace troupe::models::parallel {

struct dp_bucket;

// Where a rank's shard chunks are when they are not one tensor (ZeRO 3 with memory tiers:
// paged_shard.hpp): bucket i's parameter chunk, readable from pin to unpin.
class shard_pins {
 public:
  virtual ~shard_pins() = default;
  virtual const float* pin_params(std::size_t bucket) = 0;
  virtual void unpin_params(std::size_t bucket) = 0;
};

class param_gather {
 public:
  // One group: its block (-1: the parameters outside the blocks), its [begin, length) ranges of
  // the flat buffer and the buckets inside them.
  struct group {
    std::int64_t block = -1;
    std::vector<std::pair<std::int64_t, std::int64_t>> ranges;
    std::vector<std::size_t> buckets;
    std::int64_t elements = 0;
  };

  struct options {
    int prefetch = 1;               // blocks gathered ahead of the one in use
    bool poison = false;            // released ranges are filled with NaN instead of given back
    bool measure_resident = false;  // sample layer_memory::resident_param_bytes at every use
    // The shard's chunks pinned bucket by bucket (each from its gather's issue to its wait;
    // gather_all then goes one bucket at a time); null: `shard` holds them.
    shard_pins* pins = nullptr;
  };

  // buckets: the dp buckets (every one inside one of `groups`, which tile the flat buffer);
  // shard: this rank's chunks (bucket i's at buckets[i].shard_offset). All must outlive this.
  param_gather(collective::communicator& dp, layer_memory& mem,
               const std::vector<dp_bucket>& buckets, const tensor& shard,
               std::vector<group> groups, const options& opts);

  // Gathers every bucket (issued in forward order) and waits: ZeRO 1 and 2 after the update,
  // ZeRO 3 before saving or evaluating. Everything stays gathered until the next step.
  void gather_all();
  // ZeRO 3 around forward_backward. microbatches: how many the step runs; with_hook: whether the
  // piece reports block uses (else everything is gathered here and released at end_step).
  void begin_step(int microbatches, bool with_hook);
  void on_use(std::int64_t block, block_use use);
  void end_step();
  void release_all();
  // A failed step (aborted communicator): waits for every gather in flight, ignoring its error,
  // and forgets it; the ranges it was gathering count as gathered (their contents undefined until
  // the next gather_all, or given back by release_all).
  void abandon() noexcept;

  // Seconds spent waiting for gathers since the last call (then reset).
  double take_wait_seconds();
  // Bytes gathered at most at one time (outside group + blocks, in flight included) since
  // begin_step; resident parameter bytes at most (measure_resident only) over the same time.
  std::int64_t peak_gathered_bytes() const { return peak_ * 4; }
  std::size_t peak_resident_bytes() const { return peak_resident_; }

 private:
  enum class state : std::uint8_t { released, gathering, gathered };
  void issue(std::size_t bucket);        // its all_gather, into the buffer or its staging
  void wait_bucket(std::size_t bucket);  // its all_gather done, unpadded, unpinned
  void gather(std::size_t g);
  void wait(std::size_t g);
  void release(std::size_t g);
  std::size_t group_of(std::int64_t block) const;
  bool used_within(std::int64_t block, std::size_t from, std::size_t count) const;
  void sample_resident();

  collective::communicator& comm_;
  layer_memory& mem_;
  const std::vector<dp_bucket>& buckets_;
  tensor shard_;
  std::vector<group> groups_;
  options opts_;
  std::size_t outside_ = 0;               // the index of the group with block -1
  std::vector<std::size_t> of_block_;     // block -> group
  std::vector<state> state_;              // per group
  std::vector<collective::work> works_;   // per bucket: its gather in flight
  std::vector<std::int64_t> pad_at_;      // per bucket: its staging in pad_ (padded only)
  owned_tensor pad_;                      // staging of the padded buckets' gathers
  std::vector<std::int64_t> schedule_;    // the step's block uses, in order
  std::size_t cursor_ = 0;                // the next use
  bool stepping_ = false;                 // between begin_step and end_step, with the hook
  std::int64_t gathered_ = 0, peak_ = 0;  // elements
  std::size_t peak_resident_ = 0;
  double wait_ = 0;
};

}  // namespace troupe::models::parallel
