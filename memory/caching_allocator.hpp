// caching_allocator: keeps freed blocks in size classes and hands them out again, so repeated
// allocation of the same sizes (dynamic shapes, tests, eval) does not hit the system allocator or
// cudaMalloc. Sizes round up to a class (powers of two below 1 MiB, multiples of 1 MiB above).
// Thread-safe. Every block it holds, in use or cached, is accounted in its tier.
#pragma once

#include <cstddef>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "memory/buffer.hpp"

namespace troupe::memory {

class caching_allocator {
 public:
  explicit caching_allocator(tier where = tier::host) : tier_(where) {}
  caching_allocator(const caching_allocator&) = delete;
  caching_allocator& operator=(const caching_allocator&) = delete;

  void* allocate(std::size_t bytes);
  void deallocate(void* p);  // p must come from allocate(); throws otherwise
  void empty_cache();        // return every cached (free) block to the system

  struct statistics {
    std::size_t bytes_in_use = 0;  // handed out, by class size
    std::size_t bytes_cached = 0;  // free blocks kept for reuse
    std::size_t hits = 0;          // allocations served from the cache
    std::size_t misses = 0;        // allocations that made a new block
  };
  statistics stats() const;
  static std::size_t size_class(std::size_t bytes);

 private:
  buffer make(std::size_t bytes) const;
  tier tier_;
  mutable std::mutex mu_;
  std::multimap<std::size_t, buffer> free_;  // class size -> cached blocks
  std::unordered_map<void*, buffer> live_;   // handed out
  statistics stats_;
};

}  // namespace troupe::memory
