#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>

#include "memory/arena.hpp"
#include "memory/buffer.hpp"
#include "memory/caching_allocator.hpp"
#include "memory/error.hpp"
#include "memory/gpu.hpp"

using namespace troupe::memory;

TEST_CASE("host buffers are aligned and accounted in the host tier") {
  auto before = stats(tier::host);
  {
    auto b = buffer::host(1000, 256);
    REQUIRE(b.size() == 1000);
    REQUIRE(reinterpret_cast<std::uintptr_t>(b.data()) % 256 == 0);
    std::memset(b.data(), 7, b.size());
    auto during = stats(tier::host);
    REQUIRE(during.in_use == before.in_use + 1000);
    REQUIRE(during.peak >= during.in_use);
    auto moved = std::move(b);
    REQUIRE(!b);
    REQUIRE(moved.size() == 1000);
    REQUIRE(stats(tier::host).in_use == before.in_use + 1000);
  }
  REQUIRE(stats(tier::host).in_use == before.in_use);
}

TEST_CASE("peak tracks the high-water mark and can be reset") {
  reset_peak(tier::host);
  auto base = stats(tier::host).in_use;
  {
    auto a = buffer::host(1 << 20);
    auto b = buffer::host(1 << 20);
  }
  REQUIRE(stats(tier::host).peak >= base + (2 << 20));
  reset_peak(tier::host);
  REQUIRE(stats(tier::host).peak == stats(tier::host).in_use);
}

TEST_CASE("pinned buffers fall back to page-aligned host memory without a GPU") {
  auto before = stats(tier::pinned).in_use;
  auto b = buffer::pinned(10000);
  REQUIRE(b.where() == tier::pinned);
  if (!gpu_available()) REQUIRE(reinterpret_cast<std::uintptr_t>(b.data()) % 4096 == 0);
  REQUIRE(stats(tier::pinned).in_use == before + 10000);
}

TEST_CASE("device buffers fail with a clear error when no GPU is present") {
  if (gpu_available()) {
    auto b = buffer::device(1 << 20);
    REQUIRE(b.where() == tier::device);
    REQUIRE(stats(tier::device).in_use >= (1 << 20));
  } else {
    REQUIRE_THROWS_WITH(buffer::device(16), Catch::Contains("GPU") || Catch::Contains("CUDA"));
  }
}

TEST_CASE("bad alignment is rejected with a message naming it") {
  REQUIRE_THROWS_WITH(buffer::host(10, 100), Catch::Contains("alignment"));
}

TEST_CASE("the planner shares bytes between blocks whose lifetimes do not overlap") {
  std::vector<size_spec> specs = {
      {"weights", 4096, 64},  // live for the whole step
      {"act0", 1000, 64, 0, 1},
      {"act1", 1000, 64, 2, 3},  // disjoint from act0: may reuse its bytes
      {"act2", 500, 64, 1, 2},   // overlaps both
  };
  auto plan = plan_memory(specs);
  REQUIRE(plan.naive_total == 4096 + 1024 + 1024 + 512);
  REQUIRE(plan.total < plan.naive_total);
  // No two blocks that are live together overlap in memory.
  for (std::size_t i = 0; i < specs.size(); ++i)
    for (std::size_t j = i + 1; j < specs.size(); ++j) {
      bool live_together = !(specs[i].last < specs[j].first || specs[j].last < specs[i].first);
      auto& a = plan.blocks[i];
      auto& b = plan.blocks[j];
      bool overlap = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
      INFO(a.name << " vs " << b.name);
      REQUIRE(!(live_together && overlap));
      REQUIRE(a.offset % 64 == 0);
    }
  REQUIRE(plan.offset_of("act0") == plan.offset_of("act1"));
  REQUIRE_THROWS_WITH(plan.offset_of("nope"), Catch::Contains("nope"));
}

TEST_CASE("the planner rejects duplicate names") {
  REQUIRE_THROWS_WITH(plan_memory({{"x", 1}, {"x", 2}}),
                      Catch::Contains("duplicate") && Catch::Contains("'x'"));
}

TEST_CASE("an arena holds a plan and bump-allocates scratch") {
  auto plan = plan_memory({{"a", 100}, {"b", 200}});
  arena ar(plan, 1024);
  auto* a = ar.at<char>("a");
  auto* b = ar.at<char>("b");
  REQUIRE(a != b);
  std::memset(a, 1, 100);
  std::memset(b, 2, 200);
  REQUIRE(a[99] == 1);
  void* s1 = ar.allocate(500);
  void* s2 = ar.allocate(400);
  REQUIRE(s1 != s2);
  REQUIRE_THROWS_WITH(ar.allocate(500), Catch::Contains("scratch exhausted"));
  ar.reset_scratch();
  REQUIRE(ar.allocate(500) == s1);
  REQUIRE(ar.scratch_peak() >= 900);
}

TEST_CASE("the caching allocator reuses freed blocks of the same size class") {
  caching_allocator alloc;
  void* p = alloc.allocate(3000);
  REQUIRE(alloc.stats().misses == 1);
  REQUIRE(alloc.stats().bytes_in_use == 4096);
  alloc.deallocate(p);
  REQUIRE(alloc.stats().bytes_cached == 4096);
  void* q = alloc.allocate(4000);
  REQUIRE(q == p);
  REQUIRE(alloc.stats().hits == 1);
  REQUIRE_THROWS_WITH(alloc.deallocate(reinterpret_cast<void*>(0x1234)),
                      Catch::Contains("not allocated here"));
  alloc.deallocate(q);
  alloc.empty_cache();
  REQUIRE(alloc.stats().bytes_cached == 0);
  REQUIRE(caching_allocator::size_class(3u << 20) == (3u << 20));
  REQUIRE(caching_allocator::size_class((3u << 20) + 1) == (4u << 20));
}
