// Tests of nvme_store: byte-exact round trips on both backends, corruption behind the store's back,
// the capacity limit and a real ENOSPC, io_uring refused by seccomp, O_DIRECT refused, fixed
// buffers and per-key ordering. Files go to a directory on the real disk (/var/tmp, or
// TROUPE_NVME_TEST_DIR), since tmpfs may refuse O_DIRECT on other kernels.
#include "memory/io/nvme_store.hpp"

#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "memory/buffer.hpp"
#include "memory/error.hpp"
#include "memory/io/crc32c.hpp"

namespace io = troupe::memory::io;
using troupe::memory::buffer;

namespace {

const pid_t test_pid = ::getpid();  // the parent's: forked children use the same directory

std::string test_dir(const std::string& leaf) {
  const char* env = std::getenv("TROUPE_NVME_TEST_DIR");
  std::filesystem::path base = env && *env ? env : "/var/tmp";
  return (base / ("troupe_nvme_test_" + std::to_string(test_pid)) / leaf).string();
}

io::nvme_store_options opts(const std::string& leaf, io::io_backend b) {
  io::nvme_store_options o;
  o.dir = test_dir(leaf);
  o.backend = b;
  o.queue_depth = 8;
  return o;
}

std::vector<unsigned char> random_bytes(std::size_t n, std::uint32_t seed) {
  std::vector<unsigned char> v(n);
  std::mt19937_64 g(seed);
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    std::uint64_t w = g();
    std::memcpy(v.data() + i, &w, 8);
  }
  for (; i < n; ++i) v[i] = static_cast<unsigned char>(g());
  return v;
}

// Removes this process's test directory at exit (forked children leave with _exit).
struct remove_test_dir {
  ~remove_test_dir() {
    std::error_code ec;
    std::filesystem::remove_all(std::filesystem::path(test_dir("x")).parent_path(), ec);
  }
} remove_test_dir_at_exit;

// Runs fn in a forked child; returns the child's exit code (fn's return value; 99 on a throw).
int in_child(const std::function<int()>& fn) {
  pid_t pid = ::fork();
  if (pid == 0) {
    int rc = 98;
    try {
      rc = fn();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "child: %s\n", e.what());
      rc = 99;
    }
    ::_exit(rc);
  }
  REQUIRE(pid > 0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  REQUIRE(WIFEXITED(status));
  return WEXITSTATUS(status);
}

// A seccomp filter: io_uring_setup fails with EPERM (io_uring_forbid), or an open with O_DIRECT
// fails with EINVAL (direct_forbid); everything else is allowed.
bool install_filter(bool io_uring_forbid, bool direct_forbid) {
  std::vector<sock_filter> f;
  f.push_back(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
  if (io_uring_forbid) {
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM));
  }
  if (direct_forbid) {
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_openat, 0, 4));
    f.push_back(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, args[2])));
    f.push_back(BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, O_DIRECT, 0, 1));
    f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EINVAL));
    f.push_back(BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)));
  }
  f.push_back(BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW));
  sock_fprog prog{static_cast<unsigned short>(f.size()), f.data()};
  if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0) return false;
  return ::prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0;
}

// Writes then reads back pages of the given sizes (several in flight); returns what was read.
std::vector<std::vector<unsigned char>> round_trip(io::nvme_store& s,
                                                   const std::vector<std::size_t>& sizes,
                                                   std::uint32_t seed) {
  std::vector<std::vector<unsigned char>> src, dst;
  std::vector<io::io_ticket> t;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    src.push_back(random_bytes(sizes[i], seed + static_cast<std::uint32_t>(i)));
    t.push_back(s.write(1000 + i, src.back().data(), sizes[i]));
  }
  for (auto& x : t) x.wait();
  t.clear();
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    dst.emplace_back(sizes[i], 0xEE);
    t.push_back(s.read(1000 + i, dst.back().data(), sizes[i]));
  }
  for (auto& x : t) x.wait();
  for (std::size_t i = 0; i < sizes.size(); ++i) REQUIRE(dst[i] == src[i]);
  return dst;
}

}  // namespace

TEST_CASE("crc32c matches the standard check value and the per-block form", "[memory][nvme]") {
  const char* check = "123456789";
  CHECK(io::crc32c(check, 9) == 0xE3069283u);
  // Bitwise reference, independent of the table and SSE4.2 paths.
  auto data = random_bytes(9 * 4096, 7);
  std::vector<std::uint32_t> blocks(9);
  io::crc32c_blocks(data.data(), 4096, 9, blocks.data());
  for (int b = 0; b < 9; ++b) {
    std::uint32_t c = ~0u;
    for (int i = 0; i < 4096; ++i) {
      c ^= data[b * 4096 + i];
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    }
    CHECK(blocks[b] == ~c);
  }
}

TEST_CASE("pages round trip byte exact from 4 KiB to 64 MiB on both backends", "[memory][nvme]") {
  // Aligned and unaligned sizes; vectors are not 4 KiB aligned, so the bounce path runs too.
  std::vector<std::size_t> sizes = {4096,    4096 * 3,         65536 + 17,
                                    1 << 20, (4 << 20) + 4096, 64 << 20};
  io::nvme_store a(opts("rt_uring", io::io_backend::io_uring));
  io::nvme_store b(opts("rt_pread", io::io_backend::pread));
  INFO("io_uring store: " << a.backend_note());
  CHECK(b.backend() == io::io_backend::pread);
  auto ra = round_trip(a, sizes, 11);
  auto rb = round_trip(b, sizes, 11);
  CHECK(ra == rb);
  auto st = a.stats();
  std::uint64_t total = 0;
  for (auto n : sizes) total += n;
  CHECK(st.bytes_written == total);
  CHECK(st.bytes_read == total);
  CHECK(st.writes == sizes.size());
  CHECK(st.reads == sizes.size());
  CHECK(st.failed == 0);
  CHECK(a.pages() == sizes.size());
}

TEST_CASE("many keys with several requests in flight read back byte exact", "[memory][nvme]") {
  io::nvme_store s(opts("many", io::io_backend::io_uring));
  // A pinned (4 KiB aligned) arena registered with the store: direct fixed-buffer I/O.
  constexpr std::size_t n_keys = 256, page = 64 << 10;
  buffer src = buffer::pinned(n_keys * page), dst = buffer::pinned(n_keys * page);
  auto data = random_bytes(n_keys * page, 3);
  std::memcpy(src.data(), data.data(), data.size());
  std::memset(dst.data(), 0, dst.size());
  s.register_buffer(src.data(), src.size());
  s.register_buffer(dst.data(), dst.size());
  auto* sp = static_cast<unsigned char*>(src.data());
  auto* dp = static_cast<unsigned char*>(dst.data());
  std::vector<io::io_ticket> t;
  std::size_t most_in_flight = 0;
  for (std::size_t k = 0; k < n_keys; ++k) {
    t.push_back(s.write(k, sp + k * page, page));
    most_in_flight = std::max(most_in_flight, s.in_flight());
  }
  s.wait_all();
  t.clear();
  for (std::size_t k = 0; k < n_keys; ++k) t.push_back(s.read(k, dp + k * page, page));
  std::size_t polled_done = 0;
  for (auto& x : t) polled_done += x.test() ? 1 : 0;  // test() never blocks
  for (auto& x : t) x.wait();
  CHECK(std::memcmp(dp, data.data(), data.size()) == 0);
  CHECK(most_in_flight > 1);
  CHECK(s.used_bytes() == n_keys * page);
  s.unregister_buffer(src.data());
  s.unregister_buffer(dst.data());
  INFO("completed at test(): " << polled_done);
}

TEST_CASE("requests on one key run in the order issued", "[memory][nvme]") {
  io::nvme_store s(opts("order", io::io_backend::io_uring));
  auto a = random_bytes(1 << 20, 21), b = random_bytes(3 << 20, 22);
  std::vector<unsigned char> ra(a.size()), rb(b.size());
  auto t1 = s.write(5, a.data(), a.size());
  auto t2 = s.read(5, ra.data(), ra.size());
  auto t3 = s.write(5, b.data(), b.size());  // larger: moves to a new extent
  auto t4 = s.read(5, rb.data(), rb.size());
  t4.wait();
  t1.wait();
  t2.wait();
  t3.wait();
  CHECK(ra == a);
  CHECK(rb == b);
  CHECK(s.page_bytes(5) == b.size());
  s.erase(5);
  CHECK_FALSE(s.contains(5));
  CHECK(s.used_bytes() == 0);
  std::vector<unsigned char> x(4096);
  CHECK_THROWS_WITH(s.read(5, x.data(), x.size()).wait(),
                    Catch::Contains("page key 5") && Catch::Contains("no such page"));
}

TEST_CASE("a page corrupted on disk is detected on read with file key and offset",
          "[memory][nvme]") {
  for (auto backend : {io::io_backend::io_uring, io::io_backend::pread}) {
    io::nvme_store s(opts("corrupt", backend));
    auto a = random_bytes(1 << 20, 31), b = random_bytes(1 << 20, 32);
    s.write(7, a.data(), a.size()).wait();
    s.write(8, b.data(), b.size()).wait();
    std::uint64_t bad = s.page_offset(7) + 5 * 4096 + 100;
    // Flip one byte behind the store's back with a plain pwrite on a second descriptor.
    int fd = ::open(s.path().c_str(), O_RDWR);
    REQUIRE(fd >= 0);
    unsigned char byte = 0;
    REQUIRE(::pread(fd, &byte, 1, static_cast<off_t>(bad)) == 1);
    byte ^= 0x40;
    REQUIRE(::pwrite(fd, &byte, 1, static_cast<off_t>(bad)) == 1);
    REQUIRE(::fdatasync(fd) == 0);
    ::close(fd);
    std::vector<unsigned char> r(a.size());
    std::string expect_off = "file offset " + std::to_string(s.page_offset(7) + 5 * 4096);
    CHECK_THROWS_WITH(s.read(7, r.data(), r.size()).wait(),
                      Catch::Contains(s.path()) && Catch::Contains("page key 7") &&
                          Catch::Contains(expect_off) && Catch::Contains("checksum"));
    std::vector<unsigned char> r8(b.size());
    s.read(8, r8.data(), r8.size()).wait();  // the other page is intact and still readable
    CHECK(r8 == b);
    CHECK(s.stats().checksum_errors == 1);
  }
}

TEST_CASE("the capacity limit gives a no space error and earlier pages stay readable",
          "[memory][nvme]") {
  for (auto backend : {io::io_backend::io_uring, io::io_backend::pread}) {
    auto o = opts("capacity", backend);
    o.capacity_bytes = 4096 + (3 << 20);  // header block + three 1 MiB pages
    io::nvme_store s(o);
    std::vector<std::vector<unsigned char>> src;
    for (int k = 0; k < 3; ++k) {
      src.push_back(random_bytes(1 << 20, 40 + k));
      s.write(k, src.back().data(), src.back().size()).wait();
    }
    auto extra = random_bytes(1 << 20, 49);
    CHECK_THROWS_WITH(
        s.write(3, extra.data(), extra.size()).wait(),
        Catch::Contains("no space") && Catch::Contains(s.path()) && Catch::Contains("page key 3"));
    CHECK_FALSE(s.contains(3));
    for (int k = 0; k < 3; ++k) {
      std::vector<unsigned char> r(1 << 20);
      s.read(k, r.data(), r.size()).wait();
      CHECK(r == src[k]);
    }
    s.erase(1);  // freed space is reused
    s.write(3, extra.data(), extra.size()).wait();
    std::vector<unsigned char> r(1 << 20);
    s.read(3, r.data(), r.size()).wait();
    CHECK(r == extra);
    CHECK(s.file_bytes() <= o.capacity_bytes);
  }
}

TEST_CASE("a full file system gives ENOSPC naming the path and earlier pages stay readable",
          "[memory][nvme]") {
  // A 3 MiB tmpfs in a private mount namespace of a child process: nothing outside changes.
  int rc = in_child([] {
    if (::unshare(CLONE_NEWNS) != 0) return 77;
    if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) return 77;
    std::string dir = test_dir("enospc");
    std::filesystem::create_directories(dir);
    if (::mount("tmpfs", dir.c_str(), "tmpfs", 0, "size=3m") != 0) return 77;
    io::nvme_store_options o;
    o.dir = dir;
    io::nvme_store s(o);
    std::vector<std::vector<unsigned char>> src;
    std::string err;
    for (int k = 0; k < 8 && err.empty(); ++k) {
      auto d = random_bytes(1 << 20, 60 + k);
      try {
        s.write(k, d.data(), d.size()).wait();
        src.push_back(std::move(d));
      } catch (const troupe::error& e) {
        err = e.what();
      }
    }
    if (err.find("no space left on device") == std::string::npos) return 2;
    if (err.find(s.path()) == std::string::npos) return 3;
    if (src.empty()) return 4;
    for (std::size_t k = 0; k < src.size(); ++k) {
      std::vector<unsigned char> r(1 << 20);
      s.read(k, r.data(), r.size()).wait();
      if (r != src[k]) return 5;
    }
    return 0;
  });
  if (rc == 77) {
    WARN("troupe-skip: cannot mount a private tmpfs here");
    return;
  }
  CHECK(rc == 0);
}

TEST_CASE("io_uring refused by seccomp falls back to pread and says so", "[memory][nvme]") {
  int rc = in_child([] {
    if (!install_filter(true, false)) return 77;
    io::nvme_store s(opts("refused", io::io_backend::io_uring));  // asks for io_uring
    if (s.backend() != io::io_backend::pread) return 2;
    if (s.backend_note().find("io_uring_queue_init refused") == std::string::npos) return 3;
    auto d = random_bytes((2 << 20) + 5, 71);
    std::vector<unsigned char> r(d.size());
    s.write(1, d.data(), d.size()).wait();
    s.read(1, r.data(), r.size()).wait();
    return r == d ? 0 : 4;
  });
  if (rc == 77) {
    WARN("troupe-skip: cannot install a seccomp filter here");
    return;
  }
  CHECK(rc == 0);
}

TEST_CASE("the backend can be forced by option or environment variable", "[memory][nvme]") {
  io::nvme_store a(opts("forced", io::io_backend::pread));
  CHECK(a.backend() == io::io_backend::pread);
  CHECK(a.backend_note().find("options.backend") != std::string::npos);
  REQUIRE(::setenv("TROUPE_NVME_BACKEND", "pread", 1) == 0);
  io::nvme_store_options o;
  o.dir = test_dir("env");
  io::nvme_store b(o);
  CHECK(b.backend() == io::io_backend::pread);
  CHECK(b.backend_note().find("TROUPE_NVME_BACKEND") != std::string::npos);
  REQUIRE(::setenv("TROUPE_NVME_BACKEND", "bogus", 1) == 0);
  o.dir = test_dir("env_bogus");  // b's file is live: a store on it would be refused
  CHECK_THROWS_WITH(io::nvme_store(o), Catch::Contains("TROUPE_NVME_BACKEND=bogus"));
  ::unsetenv("TROUPE_NVME_BACKEND");
  CHECK(io::backend_name(io::io_backend::io_uring) == "io_uring");
}

TEST_CASE("a second store on a live file is refused and the first keeps its pages",
          "[memory][nvme]") {
  io::nvme_store a(opts("twice", io::io_backend::pread));
  auto d = random_bytes(1 << 16, 61);
  a.write(1, d.data(), d.size()).wait();
  CHECK_THROWS_WITH(io::nvme_store(opts("twice", io::io_backend::pread)),
                    Catch::Contains(a.path()) && Catch::Contains("exists"));
  std::vector<unsigned char> r(d.size());
  a.read(1, r.data(), r.size()).wait();
  CHECK(r == d);
  CHECK(std::filesystem::exists(a.path()));
}

TEST_CASE("O_DIRECT refused by the file system falls back to buffered I/O", "[memory][nvme]") {
  int rc = in_child([] {
    if (!install_filter(false, true)) return 77;
    io::nvme_store s(opts("nodirect", io::io_backend::io_uring));
    if (s.direct_io()) return 2;
    if (s.backend_note().find("O_DIRECT refused") == std::string::npos) return 3;
    auto d = random_bytes(1 << 20, 81);
    std::vector<unsigned char> r(d.size());
    s.write(1, d.data(), d.size()).wait();
    s.read(1, r.data(), r.size()).wait();
    return r == d ? 0 : 4;
  });
  if (rc == 77) {
    WARN("troupe-skip: cannot install a seccomp filter here");
    return;
  }
  CHECK(rc == 0);
  io::nvme_store s(opts("direct", io::io_backend::io_uring));
  INFO(s.backend_note());
  CHECK(s.direct_io());  // the test directory is on a real disk
}

TEST_CASE("a read of the wrong size is an error naming the key and both sizes", "[memory][nvme]") {
  io::nvme_store s(opts("size", io::io_backend::io_uring));
  auto d = random_bytes(8192, 91);
  s.write(3, d.data(), d.size()).wait();
  std::vector<unsigned char> r(4096);
  CHECK_THROWS_WITH(s.read(3, r.data(), r.size()).wait(), Catch::Contains("page key 3") &&
                                                              Catch::Contains("4096") &&
                                                              Catch::Contains("8192"));
  CHECK(s.stats().failed == 1);
}

TEST_CASE("two threads share one store and dropped tickets still complete", "[memory][nvme]") {
  io::nvme_store s(opts("threads", io::io_backend::io_uring));
  constexpr int per_thread = 64;
  std::vector<std::vector<unsigned char>> src(2 * per_thread);
  for (int i = 0; i < 2 * per_thread; ++i) src[i] = random_bytes(40000 + 4096 * (i % 5), 100 + i);
  auto worker = [&](int first, std::vector<int>& bad) {
    for (int i = first; i < first + per_thread; ++i) {
      { auto dropped = s.write(i, src[i].data(), src[i].size()); }  // the destructor waits
    }
    std::vector<std::vector<unsigned char>> got(per_thread);
    std::vector<io::io_ticket> t;
    for (int i = 0; i < per_thread; ++i) {
      got[i].resize(src[first + i].size());
      t.push_back(s.read(first + i, got[i].data(), got[i].size()));
    }
    for (auto& x : t) x.wait();
    for (int i = 0; i < per_thread; ++i)
      if (got[i] != src[first + i]) bad.push_back(first + i);
  };
  std::vector<int> bad0, bad1;
  std::thread a(worker, 0, std::ref(bad0)), b(worker, per_thread, std::ref(bad1));
  a.join();
  b.join();
  CHECK(bad0.empty());
  CHECK(bad1.empty());
  CHECK(s.in_flight() == 0);
  CHECK(s.stats().writes == 2 * per_thread);
  CHECK(s.stats().failed == 0);
}

TEST_CASE("SQEs the kernel does not take at once are handed again and all requests complete",
          "[memory][nvme]") {
  // submit_limit 1: each io_uring_enter hands the kernel one SQE of the several prepared, as a
  // kernel short of resources may; the rest stay in the SQ ring. A store that counted them as
  // submitted would wait forever for their completions.
  auto o = opts("partial", io::io_backend::io_uring);
  o.submit_limit = 1;
  io::nvme_store s(o);
  std::vector<std::size_t> sizes;
  for (int i = 0; i < 48; ++i) sizes.push_back(4096 * (1 + i % 7) + (i % 3) * 100);
  round_trip(s, sizes, 700);
  CHECK(s.in_flight() == 0);
  CHECK(s.stats().failed == 0);
  CHECK(s.stats().reads == sizes.size());
}

TEST_CASE("a waiter blocked in the kernel lets other threads issue and test requests",
          "[memory][nvme]") {
  // While the waiter sleeps in io_uring_wait_cqe (on_block runs there), another thread issues a
  // write and tests it. A store that kept its lock while blocked would stall that thread until
  // the read completed; here it must finish while the waiter is still blocked.
  auto o = opts("unlocked_wait", io::io_backend::io_uring);
  io::nvme_store* store = nullptr;
  const auto other = random_bytes(3 * 4096 + 11, 801);
  io::io_ticket other_ticket;
  bool armed = false, tried = false, issued_while_blocked = false;
  o.on_block = [&] {
    if (!armed || tried) return;
    tried = true;
    auto f = std::async(std::launch::async, [&] {
      other_ticket = store->write(77, other.data(), other.size());
      other_ticket.test();
    });
    issued_while_blocked = f.wait_for(std::chrono::seconds(20)) == std::future_status::ready;
  };
  io::nvme_store s(o);
  store = &s;
  constexpr std::size_t page = 16 << 20;
  buffer src = buffer::pinned(page), dst = buffer::pinned(page);
  auto data = random_bytes(page, 802);
  std::memcpy(src.data(), data.data(), page);
  s.write(1, src.data(), page).wait();
  armed = true;  // from here on: the reads below
  for (int i = 0; i < 50 && !tried; ++i) s.read(1, dst.data(), page).wait();  // until one blocks
  REQUIRE(tried);
  CHECK(issued_while_blocked);
  other_ticket.wait();
  CHECK(std::memcmp(dst.data(), data.data(), page) == 0);
  std::vector<unsigned char> back(other.size());
  s.read(77, back.data(), back.size()).wait();
  CHECK(back == other);
}

TEST_CASE("four threads waiting on one store at once all get their pages", "[memory][nvme]") {
  auto o = opts("four_threads", io::io_backend::io_uring);
  o.queue_depth = 2;  // more requests than slots: waiters take turns reaping for each other
  io::nvme_store s(o);
  constexpr int threads = 4, per_thread = 32;
  std::vector<int> bad(threads, 0);
  auto worker = [&](int w) {
    std::vector<std::vector<unsigned char>> src(per_thread), got(per_thread);
    std::vector<io::io_ticket> t;
    for (int i = 0; i < per_thread; ++i) {
      src[i] = random_bytes(8192 + 512 * i, 900 + w * per_thread + i);
      t.push_back(s.write(w * per_thread + i, src[i].data(), src[i].size()));
    }
    for (auto& x : t) x.wait();
    t.clear();
    for (int i = 0; i < per_thread; ++i) {
      got[i].resize(src[i].size());
      t.push_back(s.read(w * per_thread + i, got[i].data(), got[i].size()));
    }
    for (int i = per_thread; i-- > 0;) t[i].wait();  // the last first: others complete meanwhile
    for (int i = 0; i < per_thread; ++i) bad[w] += got[i] != src[i];
  };
  std::vector<std::thread> ts;
  for (int w = 0; w < threads; ++w) ts.emplace_back(worker, w);
  for (auto& t : ts) t.join();
  for (int w = 0; w < threads; ++w) CHECK(bad[w] == 0);
  CHECK(s.in_flight() == 0);
  CHECK(s.stats().failed == 0);
}
