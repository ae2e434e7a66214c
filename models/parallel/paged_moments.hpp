// paged_moments: a ZeRO rank's AdamW moments (m and v of its shard, dp_trainer in
// data_parallel.hpp) in the chunks of a memory::tier_manager, homed on the host or on NVMe, and
// brought in segment by segment for the update: the memory tiers as a placement of the
// data-parallel engine (dp_options::moments), not a trainer of their own.
//
// The moments' flat range [0, elements) is cut into segments of segment_bytes; segment s is two
// chunks, m (id 2s) and v (id 2s + 1). An update is one pass, segment after segment, in that order
// (the tier manager's schedule, so it prefetches the next segments' NVMe reads while the CPU
// updates the current one and evicts by Belady); AdamW is elementwise, so cutting its runs at
// segment edges changes no bit of the update. The shard's f32 parameters (ZeRO 3: the master
// copy) and its reduced gradients stay in the engine's buffers: every unit's all-gather reads the
// former and every reduce-scatter writes the latter during forward and backward, so they are in
// use for the whole step, while the moments are used only by the update - paging them off the
// step's working set takes half of a rank's persistent state (8 of its 16 bytes per shard
// parameter) down to the host pool's slots.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "memory/tier_manager.hpp"
#include "models/train_config.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::parallel {

struct moment_tiers {
  memory::tier home = memory::tier::host;  // host or nvme
  std::size_t host_bytes = 0;              // the host budget (homes on the host + slots; 0: none)
  std::string nvme_dir;                    // needed when home is nvme
  std::uint64_t nvme_capacity_bytes = 0;   // a limit on the NVMe file (0: the disk's size)
  std::shared_ptr<memory::io::page_io> nvme_io;  // null: a store of the manager's own
  std::size_t segment_bytes = std::size_t{1} << 20;
  int prefetch_depth = 4;
};

// The moments' tiers of a launched rank from the [memory] table: home memory.optimizer_tier (by
// default nvme when memory.nvme_dir is given, else host), the host budget memory.host, NVMe in
// "<memory.nvme_dir>/dp<dp_rank>" (ranks of one machine share the folder).
moment_tiers moment_tiers_of(const train_config& cfg, int dp_rank);
// The tier manager's options for these tiers (checked: the home is host or nvme, nvme has a
// folder), and the NVMe folder created (when the home is nvme and the manager has its own store).
memory::tier_manager_options manager_options(const moment_tiers& t);
void make_nvme_dir(const moment_tiers& t);

class paged_moments {
 public:
  paged_moments(std::int64_t elements, const moment_tiers& opt);

  std::int64_t elements() const { return elements_; }
  std::int64_t segment_elements() const { return segment_; }
  std::int32_t segments() const { return segments_; }

  // One pass over the segments in order: f(first, m, v) with the moments [first, first + n) of a
  // segment pinned on the host (f32 [n] views, valid during the call). write: f changed them.
  void for_each(const std::function<void(std::int64_t first, const tensor& m, const tensor& v)>& f,
                bool write);
  // All the moments to / from contiguous f32 [elements] tensors (checkpoints; off the schedule).
  void copy_out(const tensor& m, const tensor& v);
  void copy_in(const tensor& m, const tensor& v);

  memory::tier_manager& tiers() { return tiers_; }

 private:
  std::int64_t elements_, segment_;
  std::int32_t segments_;
  memory::tier_manager tiers_;
};

}  // namespace troupe::models::parallel
