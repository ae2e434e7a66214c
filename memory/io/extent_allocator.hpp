// extent_allocator: first-fit allocation of 4 KiB-aligned extents in one file, with coalescing
// of freed neighbours. Offsets start at `start` (the file's header block comes first). Not
// thread safe: nvme_store calls it under its lock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>

namespace troupe::memory::io {

struct extent {
  std::uint64_t off = 0;
  std::uint64_t len = 0;  // a multiple of 4 KiB
};

class extent_allocator {
 public:
  explicit extent_allocator(std::uint64_t start) : end_(start) {}
  // An extent of len bytes ending at or below limit, or nothing when none fits.
  std::optional<extent> allocate(std::uint64_t len, std::uint64_t limit);
  void release(extent e);
  std::uint64_t used() const { return used_; }
  std::uint64_t end() const { return end_; }  // one past the highest extent handed out

 private:
  std::map<std::uint64_t, std::uint64_t> free_;  // offset -> length, below end_
  std::uint64_t end_;
  std::uint64_t used_ = 0;
};

}  // namespace troupe::memory::io
