// The NVMe actor: pages through the actor's client byte exact with several requests in flight, a
// corrupted page and a full store reported with the store's message (and later requests still
// served), the pread fallback, a tier manager through the client against one over its own store,
// and the "nvme" role's numbers in the job snapshot. Files go to /var/tmp (or
// TROUPE_NVME_TEST_DIR): tmpfs may refuse O_DIRECT.
#include "actors/nvme_actor.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "actors/one_rank_job.hpp"
#include "memory/buffer.hpp"
#include "memory/error.hpp"
#include "memory/tier_manager.hpp"

using namespace troupe;
using namespace troupe::actors;
using namespace std::chrono_literals;
namespace io = troupe::memory::io;

namespace {

std::filesystem::path test_dir(const std::string& leaf) {
  const char* env = std::getenv("TROUPE_NVME_TEST_DIR");
  std::filesystem::path base = env && *env ? env : "/var/tmp";
  return base / ("troupe_nvme_actor_test_" + std::to_string(::getpid())) / leaf;
}

struct remove_test_dir {
  ~remove_test_dir() {
    std::error_code ec;
    std::filesystem::remove_all(test_dir("x").parent_path(), ec);
  }
} remove_test_dir_at_exit;

io::nvme_store_options store_options(const std::string& leaf) {
  io::nvme_store_options o;
  o.dir = test_dir(leaf).string();
  o.queue_depth = 8;
  return o;
}

std::vector<unsigned char> random_bytes(std::size_t n, std::uint32_t seed) {
  std::vector<unsigned char> v(n);
  std::mt19937 g(seed);
  for (auto& b : v) b = static_cast<unsigned char>(g());
  return v;
}

// Writes then reads back pages of the given sizes through `p`, all requests of a phase issued
// before the first wait; true when every page reads back byte exact (no Catch assertion: callable
// from any thread).
bool pages_round_trip(io::page_io& p, const std::vector<std::size_t>& sizes, std::uint32_t seed) {
  std::vector<std::vector<unsigned char>> src, dst;
  std::vector<io::io_ticket> t;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(random_bytes(sizes[i], seed + static_cast<std::uint32_t>(i)));
    t.push_back(p.write(100 + i, src.back().data(), sizes[i]));
  }
  for (auto& x : t) x.wait();
  t.clear();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    dst.emplace_back(sizes[i], 0xEE);
    t.push_back(p.read(100 + i, dst.back().data(), sizes[i]));
  }
  for (std::size_t i = sizes.size(); i-- > 0;) t[i].wait();
  return dst == src;
}

void round_trip(io::page_io& p, const std::vector<std::size_t>& sizes, std::uint32_t seed) {
  REQUIRE(pages_round_trip(p, sizes, seed));
}

void flip_byte(const std::string& path, std::uint64_t off) {
  int fd = ::open(path.c_str(), O_RDWR);
  REQUIRE(fd >= 0);
  unsigned char byte = 0;
  REQUIRE(::pread(fd, &byte, 1, static_cast<off_t>(off)) == 1);
  byte ^= 0x21;
  REQUIRE(::pwrite(fd, &byte, 1, static_cast<off_t>(off)) == 1);
  REQUIRE(::fdatasync(fd) == 0);
  ::close(fd);
}

}  // namespace

TEST_CASE("Pages round trip through the nvme actor with several requests in flight", "[nvme]") {
  auto o = store_options("many");
  nvme_actor* self = nullptr;
  std::atomic<std::size_t> most{0};
  o.on_block = [&] {  // the reaper thread, about to sleep in the kernel
    if (self) most = std::max<std::size_t>(most, self->store().in_flight());
  };
  nvme_actor a(o);
  self = &a;
  auto p = a.client();
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 48; ++i) sizes.push_back((256 << 10) * (1 + i % 4) + (i % 3) * 1000);
  round_trip(*p, sizes, 10);
  auto m = a.metrics();
  std::uint64_t total = 0;
  for (auto s : sizes) total += s;
  CHECK(m.at("nvme.bytes_written") == static_cast<double>(total));
  CHECK(m.at("nvme.bytes_read") == static_cast<double>(total));
  CHECK(m.at("nvme.in_flight") == 0);
  CHECK(m.at("nvme.failed") == 0);
  CHECK(m.at("nvme.write_gbps") > 0);
  CHECK(most > 1);  // the actor had several requests in the kernel at once
  CHECK(p->used_bytes() == a.store().used_bytes());
  p->remove(100);
  CHECK_FALSE(a.store().contains(100));
}

TEST_CASE("Two clients of one nvme actor in two threads get their own pages", "[nvme]") {
  nvme_actor a(store_options("two_clients"));
  auto p1 = a.client(), p2 = a.client();
  std::vector<std::size_t> sizes(24, 100000);
  bool first_ok = false;
  std::thread t([&] { first_ok = pages_round_trip(*p1, sizes, 60); });  // keys 100..123
  std::vector<std::vector<unsigned char>> mine;
  for (int i = 0; i < 24; ++i) {
    mine.push_back(random_bytes(50000, 70 + i));
    p2->write(5000 + i, mine.back().data(), mine.back().size()).wait();
  }
  t.join();
  CHECK(first_ok);
  for (int i = 0; i < 24; ++i) {
    std::vector<unsigned char> r(mine[i].size());
    p2->read(5000 + i, r.data(), r.size()).wait();
    CHECK(r == mine[i]);
  }
  // A request the store refuses at issue comes back as an error, not as a stuck ticket.
  CHECK_THROWS_WITH(p2->write(9, nullptr, 0).wait(),
                    Catch::Contains("page key 9") || Catch::Contains("for key 9"));
}

TEST_CASE("A corrupted page read through the nvme actor names the file and key", "[nvme]") {
  nvme_actor a(store_options("corrupt"));
  auto p = a.client();
  auto x = random_bytes(1 << 20, 20), y = random_bytes(1 << 20, 21);
  p->write(7, x.data(), x.size()).wait();
  p->write(8, y.data(), y.size()).wait();
  flip_byte(p->path(), a.store().page_offset(7) + 3 * 4096 + 17);
  std::vector<unsigned char> r(x.size());
  const std::string off = "file offset " + std::to_string(a.store().page_offset(7) + 3 * 4096);
  CHECK_THROWS_WITH(p->read(7, r.data(), r.size()).wait(),
                    Catch::Contains(p->path()) && Catch::Contains("page key 7") &&
                        Catch::Contains(off) && Catch::Contains("checksum"));
  std::vector<unsigned char> r8(y.size());
  p->read(8, r8.data(), r8.size()).wait();  // the actor goes on serving
  CHECK(r8 == y);
  CHECK(a.metrics().at("nvme.checksum_errors") == 1);
}

TEST_CASE("A full nvme store reports ENOSPC naming the path and later requests work", "[nvme]") {
  auto o = store_options("full");
  o.capacity_bytes = 4096 + (2 << 20);  // the header block and two 1 MiB pages
  nvme_actor a(o);
  auto p = a.client();
  auto x = random_bytes(1 << 20, 30), y = random_bytes(1 << 20, 31), z = random_bytes(1 << 20, 32);
  auto tx = p->write(1, x.data(), x.size());
  auto ty = p->write(2, y.data(), y.size());
  auto tz = p->write(3, z.data(), z.size());
  tx.wait();
  ty.wait();
  CHECK_THROWS_WITH(tz.wait(), Catch::Contains("ENOSPC") && Catch::Contains(p->path()) &&
                                   Catch::Contains("page key 3"));
  std::vector<unsigned char> r(1 << 20);
  p->read(1, r.data(), r.size()).wait();
  CHECK(r == x);
  p->remove(2);
  p->write(3, z.data(), z.size()).wait();  // room again
  p->read(3, r.data(), r.size()).wait();
  CHECK(r == z);
  CHECK(a.metrics().at("nvme.failed") == 1);
}

TEST_CASE("The nvme actor serves requests on the pread fallback", "[nvme]") {
  ::setenv("TROUPE_NVME_BACKEND", "pread", 1);
  struct unset {
    ~unset() { ::unsetenv("TROUPE_NVME_BACKEND"); }
  } unset_at_end;
  nvme_actor a(store_options("pread"));
  REQUIRE(a.store().backend() == io::io_backend::pread);
  CHECK(a.describe().find("pread") != std::string::npos);
  auto p = a.client();
  round_trip(*p, {4096, 5000, 1 << 20, 123457}, 40);
  CHECK(a.metrics().at("nvme.io_uring") == 0);
  std::vector<unsigned char> r(10);
  CHECK_THROWS_WITH(p->read(999, r.data(), r.size()).wait(),
                    Catch::Contains("page key 999") && Catch::Contains("no such page"));
}

TEST_CASE("A tier manager through the nvme actor gives the bytes of one over its own store",
          "[nvme][offload]") {
  constexpr std::size_t kib64 = 64 * 1024;
  constexpr int chunks = 6;
  nvme_actor a(store_options("tiers_actor"));
  memory::tier_manager_options base;
  base.device_bytes = 2 * kib64;
  base.host_bytes = 2 * kib64;
  base.prefetch_depth = 2;
  memory::tier_manager_options own = base, through = base;
  own.nvme_dir = test_dir("tiers_own").string();
  through.nvme_io = a.client();
  memory::tier_manager direct(own), actor(through);
  CHECK(actor.nvme_path() == a.store().path());
  std::vector<memory::chunk_use> uses;
  for (int c = 0; c < chunks; ++c) uses.push_back({c, memory::tier::host});
  for (int c = 0; c < chunks; ++c) uses.push_back({c, memory::tier::device});
  // The reference: what each chunk should hold, kept in plain vectors.
  std::vector<std::vector<unsigned char>> expect(chunks, std::vector<unsigned char>(kib64, 0));
  for (auto* tm : {&direct, &actor}) {
    for (int c = 0; c < chunks; ++c) tm->add_chunk(kib64, memory::tier::nvme);
    tm->set_schedule(uses);
  }
  for (int step = 0; step < 3; ++step) {
    for (int c = 0; c < chunks; ++c) {
      auto fresh = random_bytes(kib64, 1000 * step + c);
      std::vector<unsigned char> seen[2];
      int k = 0;
      for (auto* tm : {&direct, &actor}) {
        auto* h = reinterpret_cast<unsigned char*>(tm->acquire(c, memory::tier::host));
        seen[k++].assign(h, h + kib64);
        std::memcpy(h, fresh.data(), kib64);
        tm->release(c, memory::tier::host, true);
      }
      CHECK(seen[0] == expect[c]);
      CHECK(seen[1] == expect[c]);
      expect[c] = fresh;
    }
    for (int c = 0; c < chunks; ++c) {
      for (auto* tm : {&direct, &actor}) {
        auto* d = reinterpret_cast<unsigned char*>(tm->acquire(c, memory::tier::device));
        CHECK(std::memcmp(d, expect[c].data(), kib64) == 0);
        tm->release(c, memory::tier::device, false);
      }
    }
  }
  direct.flush();
  actor.flush();
  auto rd = direct.report(), ra = actor.report();
  CHECK(ra.nvme_write_bytes == rd.nvme_write_bytes);
  CHECK(ra.nvme_read_bytes == rd.nvme_read_bytes);
  CHECK(ra.nvme_write_bytes > 0);
  CHECK(a.metrics().at("nvme.bytes_written") >= static_cast<double>(ra.nvme_write_bytes));
}

TEST_CASE("The nvme role actor shows its store numbers in the job snapshot", "[nvme]") {
  one_rank_job w(
      [](role_registry& roles) {
        add_nvme_role(roles);
        add_nvme_role(roles);  // a second registration is a no-op
      },
      "nvme-actor-test");
  job jb(*w.n);
  auto h = jb.spawn(nvme_role, 0);
  CHECK_THROWS_WITH(nvme_client(*w.n, h), Catch::Contains(h.name) && Catch::Contains("nvme_open"));
  nvme_open open;
  open.dir = test_dir("role").string();
  const auto what = jb.ask<std::string>(h, open, 10s);
  CHECK(what.find(open.dir) != std::string::npos);
  {
    auto p = nvme_client(*w.n, h);
    round_trip(*p, {1 << 20, 1 << 20, 70000}, 50);
  }
  auto numbers = jb.ask<std::map<std::string, double>>(h, nvme_numbers_request{}, 10s);
  const double bytes = 2 * (1 << 20) + 70000;
  CHECK(numbers.at("nvme.bytes_written") == bytes);
  CHECK(numbers.at("nvme.bytes_read") == bytes);
  job_snapshot snap;
  const actor_state* s = w.find(h.name, snap);
  REQUIRE(s != nullptr);
  CHECK(s->role == nvme_role);
  CHECK(s->activity == what);
  CHECK(s->metrics.at("nvme.bytes_written") == bytes);
  CHECK(s->metrics.at("nvme.in_flight") == 0);
  CHECK(s->metrics.count("nvme.o_direct") == 1);
  jb.stop(h);
}
