#include "memory/arena.hpp"

#include <algorithm>
#include <numeric>
#include <unordered_set>

#include "memory/error.hpp"

namespace troupe::memory {
namespace {
std::size_t align_up(std::size_t x, std::size_t a) {
  return (x + a - 1) / a * a;
}
}  // namespace

std::size_t memory_plan::offset_of(std::string_view name) const {
  for (const auto& b : blocks)
    if (b.name == name) return b.offset;
  TROUPE_FAIL("memory plan has no block named '", name, "'");
}

memory_plan plan_memory(const std::vector<size_spec>& specs) {
  memory_plan plan;
  plan.blocks.resize(specs.size());
  std::unordered_set<std::string_view> names;
  for (std::size_t i = 0; i < specs.size(); ++i) {
    const auto& s = specs[i];
    TROUPE_CHECK(names.insert(s.name).second, "memory plan: duplicate size spec '", s.name, "'");
    TROUPE_CHECK(s.alignment > 0 && (s.alignment & (s.alignment - 1)) == 0,
                 "memory plan: alignment of '", s.name, "' must be a power of two, got ",
                 s.alignment);
    TROUPE_CHECK(s.first <= s.last, "memory plan: '", s.name, "' has first > last");
    plan.blocks[i] = {s.name, 0, s.bytes};
    plan.naive_total += align_up(s.bytes, s.alignment);
  }
  std::vector<std::size_t> order(specs.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return specs[a].bytes > specs[b].bytes; });
  std::vector<std::size_t> placed;
  for (std::size_t i : order) {
    const auto& s = specs[i];
    // Intervals of already-placed blocks that are live at the same time as s, by offset.
    std::vector<std::pair<std::size_t, std::size_t>> busy;
    for (std::size_t j : placed) {
      const auto& o = specs[j];
      if (o.last < s.first || s.last < o.first) continue;
      busy.emplace_back(plan.blocks[j].offset, plan.blocks[j].offset + o.bytes);
    }
    std::sort(busy.begin(), busy.end());
    // Best fit: the smallest gap that holds s; else after the last busy block.
    std::size_t best = SIZE_MAX, best_gap = SIZE_MAX, cursor = 0;
    for (auto [lo, hi] : busy) {
      std::size_t start = align_up(cursor, s.alignment);
      if (start + s.bytes <= lo && lo - start < best_gap) {
        best = start;
        best_gap = lo - start;
      }
      cursor = std::max(cursor, hi);
    }
    if (best == SIZE_MAX) best = align_up(cursor, s.alignment);
    plan.blocks[i].offset = best;
    plan.total = std::max(plan.total, best + s.bytes);
    placed.push_back(i);
  }
  return plan;
}

arena::arena(const memory_plan& plan, std::size_t scratch_bytes, tier where, bool releasable) {
  planned_ = align_up(plan.total, 64);
  std::size_t bytes = planned_ + scratch_bytes;
  switch (where) {
    case tier::host:
      buf_ = releasable ? buffer::host_pages(bytes) : buffer::host(bytes);
      break;
    case tier::pinned:
      buf_ = buffer::pinned(bytes);
      break;
    case tier::device:
      buf_ = buffer::device(bytes);
      break;
    case tier::nvme:
      TROUPE_FAIL("an arena cannot live on the nvme tier");
  }
  for (const auto& b : plan.blocks) offsets_.emplace(b.name, b.offset);
}

void* arena::at(std::string_view name) const {
  auto it = offsets_.find(std::string(name));
  TROUPE_CHECK(it != offsets_.end(), "arena has no planned block named '", name, "'");
  return static_cast<char*>(buf_.data()) + it->second;
}

void* arena::allocate(std::size_t bytes, std::size_t alignment) {
  std::size_t start = align_up(planned_ + scratch_used_, alignment);
  TROUPE_CHECK(start + bytes <= buf_.size(), "arena scratch exhausted: asked ", bytes,
               " bytes, capacity ", buf_.size() - planned_, " bytes of scratch, ", scratch_used_,
               " in use");
  scratch_used_ = start + bytes - planned_;
  scratch_peak_ = std::max(scratch_peak_, scratch_used_);
  return static_cast<char*>(buf_.data()) + start;
}

}  // namespace troupe::memory
