// Chunk packing and the chunk size choice, against hand-worked layouts.
#include <catch2/catch.hpp>

#include <vector>

#include "memory/chunk.hpp"
#include "memory/error.hpp"

using namespace troupe::memory;

TEST_CASE("tensors are packed in order and never straddle two chunks", "[offload]") {
  // chunk 100, alignment 4: [60@0 30@60] [20@0 50@20] [50@0]; 3 x 100 - 210 bytes wasted.
  std::vector<std::size_t> sizes{60, 30, 20, 50, 50};
  chunk_layout l = pack_chunks(sizes, 100, 4);
  REQUIRE(l.chunks == 3);
  REQUIRE(l.payload_bytes == 210);
  REQUIRE(l.wasted_bytes() == 90);
  const std::vector<std::pair<int, std::size_t>> want{{0, 0}, {0, 60}, {1, 0}, {1, 20}, {2, 0}};
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    CHECK(l.records[i].chunk == want[i].first);
    CHECK(l.records[i].offset == want[i].second);
    CHECK(l.records[i].bytes == sizes[i]);
  }
  REQUIRE(l.members.size() == 3);
  CHECK(l.members[1] == std::vector<std::int32_t>{2, 3});
}

TEST_CASE("a tensor larger than a chunk is refused") {
  std::vector<std::size_t> sizes{10, 200};
  REQUIRE_THROWS_AS(pack_chunks(sizes, 128, 4), troupe::error);
}

TEST_CASE("the chunk size that wastes the fewest bytes is chosen", "[offload]") {
  // 3 x 96 KiB + 32 KiB. 64 KiB cannot hold 96 KiB; 128 KiB: [96][96][96 32] wastes 64 KiB;
  // 256 KiB: [96 96][96 32] wastes 192 KiB; 512 KiB and up: one chunk, 192 KiB and more.
  const std::size_t k = 1024;
  std::vector<std::size_t> sizes{96 * k, 96 * k, 96 * k, 32 * k};
  auto cands = default_chunk_candidates();
  REQUIRE(cands.front() == 64 * k);
  REQUIRE(cands.back() == 64 * k * k);
  auto c = choose_chunk_size(sizes, cands);
  REQUIRE(c.layout.chunk_bytes == 128 * k);
  REQUIRE(c.layout.wasted_bytes() == 64 * k);
  REQUIRE(c.layout.chunks == 3);
  REQUIRE(c.trials.size() == cands.size());
  CHECK_FALSE(c.trials[0].feasible);
  CHECK(c.trials[2].wasted_bytes == 192 * k);
  std::vector<std::size_t> huge{cands.back() + 1};
  REQUIRE_THROWS_AS(choose_chunk_size(huge, cands), troupe::error);
}
