// paged_shard (see paged_shard.hpp): a ZeRO 3 shard's parameters, gradients and moments in
// tier-manager chunks.
#include "models/parallel/paged_shard.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "memory/error.hpp"
#include "models/parallel/data_parallel.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {
namespace {

using memory::tier;

constexpr const char* part_names[4] = {"params", "grads", "m", "v"};

// ops::sum_squares's fixed chunking (tensor/cpu/kernel_util.hpp: reduce_chunks with elem_grain
// elements per chunk, at most max_reduce_chunks chunks): a tensor of at most `grain` elements is
// one partial, and partials are added in order.
constexpr std::int64_t sum_grain = 32768;
constexpr std::int64_t sum_max_chunks = 256;

}  // namespace

paged_shard::paged_shard(const std::vector<dp_bucket>& buckets, const moment_tiers& opt)
    : buckets_(buckets), tiers_(manager_options(opt)) {
  make_nvme_dir(opt);
  const std::int64_t seg_elems =
      std::max<std::int64_t>(static_cast<std::int64_t>(opt.segment_bytes / 4), 16);
  seg_of_.assign(buckets.size(), -1);
  for (std::size_t i = 0; i < buckets.size(); ++i) {
    const dp_bucket& b = buckets[i];
    TROUPE_CHECK(b.shard_offset == elements_, "paged_shard: bucket ", i, " starts at ",
                 b.shard_offset, " of the shard, expected ", elements_);
    if (segs_.empty() || segs_.back().second + b.chunk > seg_elems)
      segs_.emplace_back(elements_, 0);
    segs_.back().second += b.chunk;
    seg_of_[i] = static_cast<std::int32_t>(segs_.size() - 1);
    elements_ += b.chunk;
  }
  if (segs_.empty()) segs_.emplace_back(0, 1);  // an empty shard: one element, as in memory
  elements_ = std::max<std::int64_t>(elements_, 1);
  for (std::size_t s = 0; s < segs_.size(); ++s) {
    const std::size_t bytes =
        static_cast<std::size_t>(std::max<std::int64_t>(segs_[s].second, 1)) * 4;
    for (const char* name : part_names)
      tiers_.add_chunk(bytes, opt.home, std::string(name) + "." + std::to_string(s));
  }
  grads_touched_.assign(segs_.size(), 0);
  pins_.assign(static_cast<std::size_t>(tiers_.chunks()), 0);
  host_bytes_ = opt.host_bytes;
  // Until the first step's uses are recorded: the update's order (every chunk is used on the host,
  // none on the device; set before the first acquire, so the pools hold host slots only).
  std::vector<memory::chunk_use> first;
  for (std::int32_t c = 0; c < tiers_.chunks(); ++c) first.push_back({c, tier::host});
  tiers_.set_schedule(std::move(first));
  // The update pins a segment's four chunks at once (the gathers and reductions in flight pin
  // more: acquire() refuses one that finds every slot pinned).
  std::int64_t largest = 1;
  for (const auto& sg : segs_) largest = std::max(largest, sg.second);
  const std::size_t slot = (static_cast<std::size_t>(largest) * 4 + 4095) / 4096 * 4096;
  TROUPE_CHECK(opt.home != tier::nvme || opt.host_bytes == 0 || opt.host_bytes / slot >= 4,
               "paged_shard: the host budget memory.host (--host-memory) of ", opt.host_bytes,
               " bytes holds ", opt.host_bytes / slot, " segments of ", slot,
               " bytes; the ZeRO 3 shard's update needs 4 at once (parameters, gradients, m, v)");
}

std::byte* paged_shard::acquire(std::int32_t chunk, bool discard) {
  // A chunk that needs a slot when every slot is pinned: the tier manager would refuse naming
  // its budget; name the setting instead.
  const std::size_t slots = tiers_.slots(tier::host);
  TROUPE_CHECK(tiers_.home(chunk) == tier::host || slots == 0 || pinned_ < slots ||
                   tiers_.state(chunk, tier::host) != memory::chunk_state::evicted,
               "paged_shard: the host budget memory.host (--host-memory) of ", host_bytes_,
               " bytes holds ", slots, " segments of ", tiers_.chunk_bytes(chunk),
               " bytes or less, all pinned by the parameter gathers and gradient reductions in "
               "flight (chunk ",
               chunk,
               " needs one): give it more, or cut smaller buckets "
               "(parallel.dp_bucket_bytes, --dp-bucket-bytes)");
  // A discarding acquire stays off the schedule (else prefetch would read bytes nobody needs).
  if (recording_ && !discard) record_.push_back({chunk, tier::host});
  std::byte* p = tiers_.acquire(chunk, tier::host, discard);
  if (pins_[static_cast<std::size_t>(chunk)]++ == 0) ++pinned_;
  return p;
}

void paged_shard::release(std::int32_t chunk, bool dirty) {
  tiers_.release(chunk, tier::host, dirty);
  if (--pins_[static_cast<std::size_t>(chunk)] == 0) --pinned_;
}

void paged_shard::begin_step() {
  tiers_.rewind();
  std::fill(grads_touched_.begin(), grads_touched_.end(), 0);
  recording_ = !scheduled_;
  record_.clear();
}

void paged_shard::end_step() {
  if (recording_) {
    tiers_.set_schedule(record_);
    scheduled_ = true;
  }
  recording_ = false;
  record_.clear();
}

void paged_shard::abandon_step() {
  recording_ = false;
  record_.clear();
}

const float* paged_shard::pin_params(std::size_t bucket) {
  const std::int32_t s = seg_of_[bucket];
  std::byte* p = acquire(4 * s + params, false);
  return reinterpret_cast<const float*>(p) + (buckets_[bucket].shard_offset - segs_[s].first);
}

void paged_shard::unpin_params(std::size_t bucket) {
  release(4 * seg_of_[bucket] + params, false);
}

float* paged_shard::pin_grads(std::size_t bucket) {
  const std::int32_t s = seg_of_[bucket];
  // The step's first use of the segment: its bytes are last step's, and every bucket's first
  // reduction of this step overwrites its chunk before anything reads it.
  const bool discard = grads_touched_[s] == 0;
  grads_touched_[s] = 1;
  std::byte* p = acquire(4 * s + grads, discard);
  return reinterpret_cast<float*>(p) + (buckets_[bucket].shard_offset - segs_[s].first);
}

void paged_shard::unpin_grads(std::size_t bucket) {
  release(4 * seg_of_[bucket] + grads, true);
}

void paged_shard::for_each(std::initializer_list<part> parts, const segment_fn& f, bool write,
                           bool discard) {
  for (std::size_t s = 0; s < segs_.size(); ++s) {
    const auto [first, n] = segs_[s];
    tensor views[4];
    std::vector<std::int32_t> held;
    try {
      for (part k : parts) {
        const auto id = static_cast<std::int32_t>(4 * s + k);
        std::byte* p = acquire(id, discard);
        held.push_back(id);
        views[k] = tensor(p, static_cast<std::size_t>(std::max<std::int64_t>(n, 1)) * 4, dtype::f32,
                          {n}, device::cpu());
      }
      f(first, views);
    } catch (...) {
      for (auto id : held) release(id, false);
      throw;
    }
    for (auto id : held) release(id, write);
  }
}

double paged_shard::grad_sum_squares(std::int64_t begin, std::int64_t length) {
  if (length <= 0) return 0;
  TROUPE_CHECK(begin >= 0 && begin + length <= elements_, "paged_shard: norm range [", begin, ", +",
               length, ") is outside the shard of ", elements_);
  const std::int64_t chunks =
      std::clamp<std::int64_t>((length + sum_grain - 1) / sum_grain, 1, sum_max_chunks);
  double total = 0;
  std::int64_t c = 0;       // the next partial
  std::int64_t filled = 0;  // of it, elements in scratch_ (it straddles segments)
  for (std::size_t s = 0; s < segs_.size() && c < chunks; ++s) {
    const auto [first, n] = segs_[s];
    if (first + n <= begin + length * c / chunks) continue;  // before the next partial
    if (first >= begin + length) break;
    const auto id = static_cast<std::int32_t>(4 * s + grads);
    const float* g = reinterpret_cast<const float*>(acquire(id, false));
    try {
      while (c < chunks) {
        const std::int64_t lo = begin + length * c / chunks, hi = begin + length * (c + 1) / chunks;
        const std::int64_t from = std::max(lo + filled, first), to = std::min(hi, first + n);
        if (from >= to) break;
        if (filled == 0 && to == hi) {  // whole in this segment
          total += ops::sum_squares(tensor(const_cast<float*>(g) + (lo - first),
                                           static_cast<std::size_t>(hi - lo) * 4, dtype::f32,
                                           {hi - lo}, device::cpu()));
          ++c;
          continue;
        }
        scratch_.resize(static_cast<std::size_t>(hi - lo));
        std::memcpy(scratch_.data() + filled, g + (from - first),
                    static_cast<std::size_t>(to - from) * 4);
        filled += to - from;
        if (to < hi) break;  // continues in the next segment
        total += ops::sum_squares(
            tensor(scratch_.data(), scratch_.size() * 4, dtype::f32, {hi - lo}, device::cpu()));
        filled = 0;
        ++c;
      }
    } catch (...) {
      release(id, false);
      throw;
    }
    release(id, false);
  }
  TROUPE_CHECK(c == chunks, "paged_shard: the norm range [", begin, ", +", length,
               ") ran past the segments");
  return total;
}

}  // namespace troupe::models::parallel
