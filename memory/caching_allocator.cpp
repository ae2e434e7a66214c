#include "memory/caching_allocator.hpp"

#include "memory/error.hpp"

namespace troupe::memory {

std::size_t caching_allocator::size_class(std::size_t bytes) {
  constexpr std::size_t mib = std::size_t{1} << 20;
  if (bytes <= 512) return 512;
  if (bytes >= mib) return (bytes + mib - 1) / mib * mib;
  std::size_t c = 512;
  while (c < bytes) c <<= 1;
  return c;
}

buffer caching_allocator::make(std::size_t bytes) const {
  switch (tier_) {
    case tier::host:
      return buffer::host(bytes);
    case tier::pinned:
      return buffer::pinned(bytes);
    case tier::device:
      return buffer::device(bytes);
    case tier::nvme:
      break;
  }
  TROUPE_FAIL("caching_allocator cannot allocate on the nvme tier");
}

void* caching_allocator::allocate(std::size_t bytes) {
  std::size_t c = size_class(bytes);
  std::lock_guard lock(mu_);
  buffer b;
  auto it = free_.find(c);
  if (it != free_.end()) {
    b = std::move(it->second);
    free_.erase(it);
    stats_.bytes_cached -= c;
    ++stats_.hits;
  } else {
    b = make(c);
    ++stats_.misses;
  }
  void* p = b.data();
  stats_.bytes_in_use += c;
  live_.emplace(p, std::move(b));
  return p;
}

void caching_allocator::deallocate(void* p) {
  if (p == nullptr) return;
  std::lock_guard lock(mu_);
  auto it = live_.find(p);
  TROUPE_CHECK(it != live_.end(), "caching_allocator::deallocate: pointer ", p,
               " was not allocated here (double free?)");
  std::size_t c = it->second.size();
  stats_.bytes_in_use -= c;
  stats_.bytes_cached += c;
  free_.emplace(c, std::move(it->second));
  live_.erase(it);
}

void caching_allocator::empty_cache() {
  std::lock_guard lock(mu_);
  free_.clear();
  stats_.bytes_cached = 0;
}

caching_allocator::statistics caching_allocator::stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

}  // namespace troupe::memory
