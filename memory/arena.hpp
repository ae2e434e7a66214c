// The memory planner and the arena that holds a plan.
//
// Before step 1 every component names what it needs (a size spec: name, bytes, alignment and the
// interval of the step during which it is live). plan_memory() assigns offsets so that specs whose
// live intervals overlap never share bytes, and specs that are never live at the same time may;
// the arena then makes one allocation for the whole plan. The steady-state step does not allocate.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "memory/buffer.hpp"

namespace troupe::memory {

struct size_spec {
  std::string name;
  std::size_t bytes = 0;
  std::size_t alignment = 64;
  // Live interval [first, last] in any ordinal the caller chooses (e.g. op index within a step).
  // The default is live for the whole step.
  std::int64_t first = 0;
  std::int64_t last = std::numeric_limits<std::int64_t>::max();
};

struct planned_block {
  std::string name;
  std::size_t offset = 0;
  std::size_t bytes = 0;
};

struct memory_plan {
  std::vector<planned_block> blocks;  // in the order the specs were given
  std::size_t total = 0;              // bytes needed to hold every block
  std::size_t naive_total = 0;        // bytes without reuse (sum of aligned sizes), for reports
  std::size_t offset_of(std::string_view name) const;  // throws if the name is unknown
};

// Greedy best-fit by size, largest first. Throws on duplicate names or bad alignment.
memory_plan plan_memory(const std::vector<size_spec>& specs);

// One allocation holding a memory plan, plus bump allocation of scratch space after it.
class arena {
 public:
  arena() = default;
  // releasable (host only): the bytes are buffer::host_pages, so release_pages can give ranges
  // of them back.
  arena(const memory_plan& plan, std::size_t scratch_bytes = 0, tier where = tier::host,
        bool releasable = false);

  void* at(std::string_view name) const;  // start of a planned block
  template <class T>
  T* at(std::string_view name) const {
    return static_cast<T*>(at(name));
  }

  // Scratch: bump allocation, released all at once by reset_scratch().
  void* allocate(std::size_t bytes, std::size_t alignment = 64);
  void reset_scratch() { scratch_used_ = 0; }

  std::size_t capacity() const { return buf_.size(); }
  std::size_t scratch_peak() const { return scratch_peak_; }
  void* base() const { return buf_.data(); }
  // See buffer::release_pages and buffer::resident_bytes (offsets from base()).
  std::size_t release_pages(std::size_t offset, std::size_t bytes) {
    return buf_.release_pages(offset, bytes);
  }
  std::size_t resident_bytes() const { return buf_.resident_bytes(); }

 private:
  buffer buf_;
  std::unordered_map<std::string, std::size_t> offsets_;
  std::size_t planned_ = 0;
  std::size_t scratch_used_ = 0;
  std::size_t scratch_peak_ = 0;
};

}  // namespace troupe::memory
