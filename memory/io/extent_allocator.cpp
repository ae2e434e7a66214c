// extent_allocator: see extent_allocator.hpp.
#include "memory/io/extent_allocator.hpp"

#include "memory/error.hpp"

namespace troupe::memory::io {

std::optional<extent> extent_allocator::allocate(std::uint64_t len, std::uint64_t limit) {
  TROUPE_CHECK(len > 0 && len % 4096 == 0, "extent_allocator: length ", len,
               " is not a positive multiple of 4096");
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < len) continue;
    extent e{it->first, len};
    std::uint64_t rest = it->second - len;
    free_.erase(it);
    if (rest) free_.emplace(e.off + len, rest);
    used_ += len;
    return e;
  }
  if (end_ + len > limit || end_ + len < end_) return std::nullopt;
  extent e{end_, len};
  end_ += len;
  used_ += len;
  return e;
}

void extent_allocator::release(extent e) {
  if (e.len == 0) return;
  used_ -= e.len;
  auto next = free_.lower_bound(e.off);
  if (next != free_.begin()) {  // merge with the free extent just before
    auto prev = std::prev(next);
    if (prev->first + prev->second == e.off) {
      e.off = prev->first;
      e.len += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && e.off + e.len == next->first) {  // and the one just after
    e.len += next->second;
    free_.erase(next);
  }
  if (e.off + e.len == end_)
    end_ = e.off;  // the tail shrinks back
  else
    free_.emplace(e.off, e.len);
}

}  // namespace troupe::memory::io
