// The tier manager: Belady eviction against a brute-force optimum, coherence of copies across
// device, host and NVMe, prefetch, budgets, and a corrupted NVMe page.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "memory/error.hpp"
#include "memory/tier_manager.hpp"

using namespace troupe::memory;

namespace {

constexpr std::size_t kib64 = 64 * 1024;

// The fewest misses any eviction choice gives for `seq` with `slots` slots, from empty (plain
// search over every choice, memoised on (position, cached set)).
int min_misses(const std::vector<int>& seq, std::size_t slots, std::size_t pos, std::set<int> cache,
               std::map<std::pair<std::size_t, std::set<int>>, int>& memo) {
  if (pos == seq.size()) return 0;
  auto key = std::make_pair(pos, cache);
  if (auto it = memo.find(key); it != memo.end()) return it->second;
  int best;
  if (cache.count(seq[pos])) {
    best = min_misses(seq, slots, pos + 1, cache, memo);
  } else if (cache.size() < slots) {
    auto c = cache;
    c.insert(seq[pos]);
    best = 1 + min_misses(seq, slots, pos + 1, c, memo);
  } else {
    best = 1 << 30;
    for (int v : cache) {
      auto c = cache;
      c.erase(v);
      c.insert(seq[pos]);
      best = std::min(best, 1 + min_misses(seq, slots, pos + 1, c, memo));
    }
  }
  memo[key] = best;
  return best;
}

// Runs one pass of `seq` (device uses) through a manager with `slots` device slots and no
// prefetch; returns the misses.
int run_pass(tier_manager& tm, const std::vector<int>& seq) {
  auto before = tm.report();
  for (int c : seq) {
    tm.acquire(c, tier::device);
    tm.release(c, tier::device, false);
  }
  auto after = tm.report();
  return static_cast<int>((after.acquires - after.hits) - (before.acquires - before.hits));
}

tier_manager make_host_chunks(int chunks, std::size_t device_slots, int prefetch = 0) {
  tier_manager_options o;
  o.device_bytes = device_slots * kib64;
  o.prefetch_depth = prefetch;
  tier_manager tm(o);
  for (int i = 0; i < chunks; ++i) tm.add_chunk(kib64, tier::host);
  return tm;
}

std::filesystem::path scratch_dir(const char* name) {
  auto d = std::filesystem::temp_directory_path() / name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

// Flips every byte of the store's file after its first block (the header): every page is bad.
void corrupt_pages(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  const off_t size = ::lseek(fd, 0, SEEK_END);
  std::vector<unsigned char> junk(static_cast<std::size_t>(size > 4096 ? size - 4096 : 0), 0xa5);
  REQUIRE(::pwrite(fd, junk.data(), junk.size(), 4096) == static_cast<ssize_t>(junk.size()));
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

TEST_CASE("belady evicts the chunk whose next use is furthest on a known schedule", "[offload]") {
  // 3 slots, uses 0 1 2 3 0 1 4 0 1 2 3 4 (repeating each step). Worked by hand: 3 evicts 2
  // (next uses 0@4 1@5 2@9), 4 evicts 3 (0@7 1@8 3@10), 2 evicts 1 (4@11, 0 and 1 only in the
  // next step, 1 later), 3 evicts 2 (4@11 0@12 2@14).
  const std::vector<int> seq{0, 1, 2, 3, 0, 1, 4, 0, 1, 2, 3, 4};
  tier_manager tm = make_host_chunks(5, 3);
  std::vector<chunk_use> uses;
  for (int c : seq) uses.push_back({c, tier::device});
  tm.set_schedule(uses);
  int misses = run_pass(tm, seq);
  REQUIRE(tm.slots(tier::device) == 3);
  CHECK(tm.eviction_log(tier::device) == std::vector<std::int32_t>{2, 3, 1, 2});
  std::map<std::pair<std::size_t, std::set<int>>, int> memo;
  CHECK(misses == min_misses(seq, 3, 0, {}, memo));
}

TEST_CASE("belady misses match the optimum on random schedules", "[offload]") {
  std::mt19937 gen(7);
  for (int trial = 0; trial < 20; ++trial) {
    std::vector<int> seq(24);
    for (int& c : seq) c = static_cast<int>(gen() % 6);
    std::size_t slots = 2 + trial % 3;
    tier_manager tm = make_host_chunks(6, slots);
    std::vector<chunk_use> uses;
    for (int c : seq) uses.push_back({c, tier::device});
    tm.set_schedule(uses);
    std::map<std::pair<std::size_t, std::set<int>>, int> memo;
    INFO("trial " << trial);
    CHECK(run_pass(tm, seq) == min_misses(seq, slots, 0, {}, memo));
  }
}

TEST_CASE("writes on one tier are seen on the other after eviction", "[offload]") {
  tier_manager tm = make_host_chunks(4, 2);
  std::vector<unsigned char> want(kib64);
  // Write every chunk on the device (each write evicts an older one to its host home).
  for (int c = 0; c < 4; ++c) {
    std::byte* p = tm.acquire(c, tier::device, true);
    std::memset(p, 10 + c, kib64);
    tm.release(c, tier::device, true);
  }
  for (int c = 0; c < 4; ++c) {
    std::byte* p = tm.acquire(c, tier::host);
    std::memset(want.data(), 10 + c, kib64);
    CHECK(std::memcmp(p, want.data(), kib64) == 0);
    p[5] = std::byte{99};  // a host write must reach the next device copy
    tm.release(c, tier::host, true);
  }
  for (int c = 0; c < 4; ++c) {
    std::byte* p = tm.acquire(c, tier::device);
    CHECK(static_cast<int>(p[5]) == 99);
    CHECK(static_cast<int>(p[6]) == 10 + c);
    tm.release(c, tier::device, false);
  }
  auto r = tm.report();
  CHECK(r.device_used <= r.device_budget);
  CHECK(r.writebacks >= 2);
}

TEST_CASE("nvme chunks survive eviction and prefetch along the schedule", "[offload]") {
  auto dir = scratch_dir("troupe_tier_test_nvme");
  {
    tier_manager_options o{.device_bytes = 2 * kib64,
                           .host_bytes = 2 * kib64,
                           .nvme_dir = dir.string(),
                           .prefetch_depth = 2};
    tier_manager tm(o);
    for (int i = 0; i < 6; ++i) tm.add_chunk(kib64, tier::nvme);
    std::vector<chunk_use> uses;
    for (int c = 0; c < 6; ++c) uses.push_back({c, tier::host});
    for (int c = 0; c < 6; ++c) uses.push_back({c, tier::device});
    tm.set_schedule(uses);
    for (int step = 0; step < 3; ++step) {
      for (int c = 0; c < 6; ++c) {  // host: check the last step's bytes, write new ones
        std::byte* p = tm.acquire(c, tier::host);
        std::uint32_t v;
        std::memcpy(&v, p + 1000, 4);
        CHECK(v == static_cast<std::uint32_t>(step == 0 ? 0 : 1000 * step + c));
        v = static_cast<std::uint32_t>(1000 * (step + 1) + c);
        std::memcpy(p + 1000, &v, 4);
        tm.release(c, tier::host, true);
      }
      for (int c = 0; c < 6; ++c) {  // device: sees the host's write
        std::byte* p = tm.acquire(c, tier::device);
        std::uint32_t v;
        std::memcpy(&v, p + 1000, 4);
        CHECK(v == static_cast<std::uint32_t>(1000 * (step + 1) + c));
        tm.release(c, tier::device, false);
      }
    }
    auto r = tm.report();
    CHECK(r.nvme_write_bytes > 0);
    CHECK(r.nvme_read_bytes > 0);
    CHECK(r.prefetches > 0);
    CHECK(r.hit_rate() > 0.3);
    CHECK(r.host_used <= 2 * kib64);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a corrupted nvme page is detected when read back", "[offload]") {
  auto dir = scratch_dir("troupe_tier_test_corrupt");
  {
    tier_manager_options o{.device_bytes = kib64, .host_bytes = kib64, .nvme_dir = dir.string()};
    tier_manager tm(o);
    std::int32_t c = tm.add_chunk(kib64, tier::nvme);
    std::byte* p = tm.acquire(c, tier::host);
    std::memset(p, 0x5a, kib64);
    tm.release(c, tier::host, true);
    tm.flush();  // the only copy is now the page on NVMe
    REQUIRE(tm.state(c, tier::host) == chunk_state::evicted);
    REQUIRE(tm.report().chunks_nvme == 1);
    corrupt_pages(tm.nvme_path());
    REQUIRE_THROWS_WITH(tm.acquire(c, tier::host), Catch::Contains("checksum mismatch"));
    // The failed read leaves no copy behind: the next acquire reads the page again (and fails
    // again) rather than handing out the bad bytes as a cache hit.
    CHECK(tm.state(c, tier::host) == chunk_state::evicted);
    REQUIRE_THROWS_WITH(tm.acquire(c, tier::host), Catch::Contains("checksum mismatch"));
    CHECK(tm.report().chunks_host == 0);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a failed prefetch leaves nothing pinned and no bad copy behind", "[offload]") {
  auto dir = scratch_dir("troupe_tier_test_prefetch_fail");
  {
    tier_manager_options o{.device_bytes = kib64,
                           .host_bytes = 2 * kib64,
                           .nvme_dir = dir.string(),
                           .prefetch_depth = 1};
    tier_manager tm(o);
    const std::int32_t a = tm.add_chunk(kib64, tier::nvme, "a");
    const std::int32_t b = tm.add_chunk(kib64, tier::nvme, "b");
    const std::int32_t c = tm.add_chunk(kib64, tier::nvme, "c");
    for (std::int32_t id : {a, b, c}) {
      std::memset(tm.acquire(id, tier::host), 0x11 * (id + 1), kib64);
      tm.release(id, tier::host, true);
    }
    tm.flush();  // every page is on NVMe
    REQUIRE(tm.report().chunks_nvme == 3);
    corrupt_pages(tm.nvme_path());
    // a (its bytes discarded: no read) is acquired first: b is prefetched, a read in flight.
    tm.set_schedule({{a, tier::host}, {b, tier::host}, {c, tier::host}});
    tm.acquire(a, tier::host, true);
    REQUIRE(tm.state(b, tier::host) != chunk_state::evicted);
    tm.release(a, tier::host, false);
    // Now c comes before b: prefetching c evicts b, whose read fails, inside the acquire of a.
    tm.set_schedule({{a, tier::host}, {c, tier::host}, {b, tier::host}});
    REQUIRE_THROWS_WITH(tm.acquire(a, tier::host), Catch::Contains("checksum mismatch"));
    // The failed acquire left a unpinned (a release without an acquire is refused) ...
    REQUIRE_THROWS_WITH(tm.release(a, tier::host, false), Catch::Contains("without an acquire"));
    REQUIRE_NOTHROW(tm.flush());
    // ... and b's bad bytes are not served as a hit.
    REQUIRE_THROWS_WITH(tm.acquire(b, tier::host), Catch::Contains("checksum mismatch"));
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("two tier managers can share one nvme directory", "[offload]") {
  auto dir = scratch_dir("troupe_tier_test_shared_dir");
  {
    tier_manager_options o{.device_bytes = kib64, .host_bytes = kib64, .nvme_dir = dir.string()};
    tier_manager t1(o);
    tier_manager t2(o);
    REQUIRE(t1.nvme_path() != t2.nvme_path());
    const std::int32_t c1 = t1.add_chunk(kib64, tier::nvme);
    const std::int32_t c2 = t2.add_chunk(kib64, tier::nvme);
    std::memset(t1.acquire(c1, tier::host), 0x31, kib64);
    t1.release(c1, tier::host, true);
    t1.flush();
    std::memset(t2.acquire(c2, tier::host), 0x32, kib64);
    t2.release(c2, tier::host, true);
    t2.flush();
    const std::byte* p1 = t1.acquire(c1, tier::host);
    const std::byte* p2 = t2.acquire(c2, tier::host);
    for (std::size_t i = 0; i < kib64; ++i) {
      if (p1[i] != std::byte{0x31} || p2[i] != std::byte{0x32}) FAIL("byte " << i << " differs");
    }
    t1.release(c1, tier::host, false);
    t2.release(c2, tier::host, false);
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("a device budget without room for one chunk slot is refused") {
  tier_manager_options o;
  o.device_bytes = kib64 / 2;
  tier_manager tm(o);
  tm.add_chunk(kib64, tier::host);
  REQUIRE_THROWS_AS(tm.acquire(0, tier::device), troupe::error);
}
