// nvme_store: io_uring engine with a pread/pwrite fallback; see nvme_store.hpp for the contract.
//
// Inside: a page table (key -> extent, size, per-block CRC32C), an extent allocator over the one
// file, per-key FIFO queues (only the front request of a key may run), a ready queue of requests
// waiting for a submission slot, and the ring. Completions are reaped by whichever caller waits.
#include "memory/io/nvme_store.hpp"

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "memory/error.hpp"
#include "memory/io/crc32c.hpp"
#include "memory/io/extent_allocator.hpp"

namespace troupe::memory::io {
namespace {

using clock_type = std::chrono::steady_clock;
constexpr unsigned max_registrations = 1024;
constexpr std::uint64_t header_bytes = nvme_block;  // block 0 of the file: magic + probe

std::uint64_t round_up(std::uint64_t n) {
  return (n + nvme_block - 1) / nvme_block * nvme_block;
}
bool aligned(const void* p) {
  return reinterpret_cast<std::uintptr_t>(p) % nvme_block == 0;
}

struct aligned_free {
  void operator()(unsigned char* p) const { std::free(p); }
};
using bounce_ptr = std::unique_ptr<unsigned char, aligned_free>;

bounce_ptr alloc_bounce(std::size_t n) {
  void* p = std::aligned_alloc(nvme_block, n);
  TROUPE_CHECK(p != nullptr, "nvme_store: cannot allocate a ", n, "-byte bounce buffer");
  return bounce_ptr(static_cast<unsigned char*>(p));
}

std::string errno_text(int e) {
  if (e == ENOSPC) return "no space left on device (ENOSPC)";
  return std::string(std::strerror(e)) + " (errno " + std::to_string(e) + ")";
}

// Time during which a counter of active requests is above zero.
struct busy_clock {
  int active = 0;
  clock_type::time_point since{};
  double seconds = 0;
  void start() {
    if (active++ == 0) since = clock_type::now();
  }
  void stop() {
    if (--active == 0) seconds += std::chrono::duration<double>(clock_type::now() - since).count();
  }
  double now_seconds() const {
    return seconds +
           (active > 0 ? std::chrono::duration<double>(clock_type::now() - since).count() : 0.0);
  }
};

}  // namespace

struct page_entry {
  extent ext;
  std::size_t bytes = 0;
  std::vector<std::uint32_t> crc;  // one per 4 KiB block of the extent's used part
};

struct request {
  std::uint64_t id = 0;
  std::uint64_t key = 0;
  bool is_write = false;
  unsigned char* user = nullptr;  // caller's buffer
  std::size_t bytes = 0;          // caller's size
  unsigned char* io = nullptr;    // what the disk sees (caller's buffer or bounce)
  bounce_ptr bounce;
  std::size_t io_len = 0;  // rounded to 4 KiB
  std::uint64_t offset = 0;
  std::size_t done = 0;  // bytes of io_len transferred (short transfers resubmit the rest)
  int buf_index = -1;
  std::vector<std::uint32_t> crc;  // write: computed at issue
  bool finished = false;
  bool detached = false;  // its ticket is gone: drop the record when it finishes
  std::string error;
};

struct registration {
  unsigned char* p = nullptr;
  std::size_t n = 0;
};

struct nvme_store::impl {
  nvme_store_options opt;
  std::string path;
  int fd = -1;
  bool direct = false;
  io_backend backend = io_backend::io_uring;
  std::string note;
  io_uring ring{};
  bool ring_ok = false;
  bool fixed_ok = false;
  std::vector<registration> regs;  // slot i = fixed buffer index i

  mutable std::mutex m;
  std::condition_variable reaped;  // a blocked reaper came back (reaping went false)
  bool reaping = false;            // a waiter is in io_uring_wait_cqe without m: only it reaps
  std::uint64_t next_id = 1;
  std::unordered_map<std::uint64_t, request> requests;
  std::unordered_map<std::uint64_t, std::deque<std::uint64_t>> key_queue;
  std::deque<std::uint64_t> ready;  // prepared, waiting for a submission slot
  unsigned submitted = 0;           // sqes prepared and not yet reaped (in the SQ ring or kernel)
  std::size_t unfinished = 0;
  std::uint64_t completed = 0;  // requests finished since the store opened
  std::unordered_map<std::uint64_t, page_entry> pages;
  extent_allocator alloc{header_bytes};
  std::uint64_t file_size = header_bytes;

  nvme_stats st;
  busy_clock read_busy, write_busy;

  // --- setup ---
  void open_file();
  void choose_backend();

  // --- request life cycle (all under m) ---
  std::uint64_t issue(request r);
  void make_ready(request& r);
  bool prepare_write(request& r);
  bool prepare_read(request& r);
  void run_sync(request& r);
  void pump();
  void flush_sq();
  unsigned in_kernel() const;
  std::size_t reap_ready();
  std::size_t poll_ring();
  template <class Done>
  void wait_until(std::unique_lock<std::mutex>& lk, Done done);
  void on_cqe(std::uint64_t id, int res);
  void finish(request& r, std::string error);
  void wait_id(std::unique_lock<std::mutex>& lk, std::uint64_t id);
  void drain(std::unique_lock<std::mutex>& lk);
  std::string where(const request& r, std::uint64_t off) const;
  void grow_file(std::uint64_t end, const request& r);
  void verify(request& r);
};

// ---------------------------------------------------------------- setup

void nvme_store::impl::open_file() {
  TROUPE_CHECK(!opt.dir.empty(), "nvme_store: options.dir is empty");
  std::error_code ec;
  std::filesystem::create_directories(opt.dir, ec);
  TROUPE_CHECK(!ec, "nvme_store: cannot create directory ", opt.dir, ": ", ec.message());
  path = (std::filesystem::path(opt.dir) / (opt.name + ".pages")).string();
  // Created here, never opened over an existing file: another store's live file stays intact.
  fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  const int create_errno = errno;
  TROUPE_CHECK(fd >= 0, "nvme_store: cannot create ", path, ": ", errno_text(create_errno),
               create_errno == EEXIST
                   ? " (the file exists: another store with this dir and options.name, "
                     "or one left by a killed process)"
                   : "");
  direct = opt.direct;
  if (direct) {  // the same file again, with O_DIRECT
    int dfd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_DIRECT);
    if (dfd >= 0) {
      ::close(fd);
      fd = dfd;
    } else {
      const int e = errno;
      direct = false;
      note =
          e == EINVAL
              ? "O_DIRECT refused by the file system of " + path + " (EINVAL at open); buffered I/O"
              : "O_DIRECT open of " + path + " failed (" + errno_text(e) + "); buffered I/O";
    }
  }
  auto fail = [&](const std::string& what) {
    ::close(fd);
    ::unlink(path.c_str());
    TROUPE_FAIL("nvme_store: ", what);
  };

  // Block 0: a header naming the file's purpose; writing it probes O_DIRECT for real.
  bounce_ptr hdr = alloc_bounce(header_bytes);
  std::memset(hdr.get(), 0, header_bytes);
  std::snprintf(
      reinterpret_cast<char*>(hdr.get()), header_bytes,
      "troupe nvme_store v1: scratch pages of one process; CRC32C side table in memory\n");
  ssize_t w = ::pwrite(fd, hdr.get(), header_bytes, 0);
  if (w < 0 && errno == EINVAL && direct) {
    direct = false;
    note = "O_DIRECT refused by the file system of " + path + " (EINVAL on write); buffered I/O";
    int bfd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (bfd < 0) fail("cannot open " + path + ": " + errno_text(errno));
    ::close(fd);
    fd = bfd;
    w = ::pwrite(fd, hdr.get(), header_bytes, 0);
  }
  if (w != static_cast<ssize_t>(header_bytes))
    fail("writing the header of " + path +
         " failed: " + (w < 0 ? errno_text(errno) : std::string("short write")));
}

void nvme_store::impl::choose_backend() {
  std::optional<io_backend> want = opt.backend;
  if (!want) {
    if (const char* env = std::getenv("TROUPE_NVME_BACKEND"); env && *env) {
      std::string v = env;
      if (v == "pread")
        want = io_backend::pread;
      else if (v == "io_uring")
        want = io_backend::io_uring;
      else
        TROUPE_FAIL("nvme_store: environment variable TROUPE_NVME_BACKEND=", v,
                    " is not one of pread, io_uring");
    }
  }
  auto add_note = [&](const std::string& s) { note += (note.empty() ? "" : "; ") + s; };
  if (want == io_backend::pread) {
    backend = io_backend::pread;
    add_note("pread/pwrite forced by " +
             std::string(opt.backend ? "options.backend" : "TROUPE_NVME_BACKEND"));
    return;
  }
  TROUPE_CHECK(opt.queue_depth >= 1, "nvme_store: options.queue_depth must be >= 1");
  int rc = io_uring_queue_init(opt.queue_depth, &ring, 0);
  if (rc < 0) {
    backend = io_backend::pread;
    add_note("io_uring_queue_init refused: " + errno_text(-rc) + "; pread/pwrite fallback");
    return;
  }
  ring_ok = true;
  backend = io_backend::io_uring;
  rc = io_uring_register_buffers_sparse(&ring, max_registrations);
  fixed_ok = rc == 0;
  if (fixed_ok)
    regs.resize(max_registrations);
  else
    add_note("registered buffers unavailable: " + errno_text(-rc));
}

// ---------------------------------------------------------------- requests

std::string nvme_store::impl::where(const request& r, std::uint64_t off) const {
  return path + ": page key " + std::to_string(r.key) + ", file offset " + std::to_string(off);
}

std::uint64_t nvme_store::impl::issue(request r) {
  std::uint64_t id = next_id++;
  r.id = id;
  auto& q = key_queue[r.key];
  q.push_back(id);
  auto& rr = requests.emplace(id, std::move(r)).first->second;
  ++unfinished;
  (rr.is_write ? write_busy : read_busy).start();
  if (q.size() == 1) make_ready(rr);
  return id;
}

void nvme_store::impl::grow_file(std::uint64_t end, const request& r) {
  if (end <= file_size) return;
  // Grow in steps (at least doubling up to 256 MiB at a time) so the file is not fallocated per
  // page; never past the capacity limit.
  std::uint64_t target = std::max(end, file_size + std::min<std::uint64_t>(file_size, 256 << 20));
  if (opt.capacity_bytes) target = std::min<std::uint64_t>(target, opt.capacity_bytes);
  target = std::max(target, end);
  int rc = ::fallocate(fd, 0, file_size, target - file_size);
  if (rc != 0 && errno == ENOSPC && target > end)
    rc = ::fallocate(fd, 0, file_size, end - file_size), target = end;
  if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) return;  // writes extend the file
  if (rc != 0) {
    int e = errno;
    throw error("nvme_store: growing " + path + " to " + std::to_string(target) +
                " bytes for a write of page key " + std::to_string(r.key) +
                " failed: " + errno_text(e));
  }
  file_size = target;
}

bool nvme_store::impl::prepare_write(request& r) {
  std::uint64_t need = r.io_len;
  if (auto it = pages.find(r.key); it != pages.end()) {
    if (it->second.ext.len >= need) {  // rewrite in place
      it->second.bytes = r.bytes;
      it->second.crc = std::move(r.crc);
      r.offset = it->second.ext.off;
      return true;
    }
    alloc.release(it->second.ext);
    pages.erase(it);
  }
  std::uint64_t limit = opt.capacity_bytes ? opt.capacity_bytes : UINT64_MAX;
  std::optional<extent> e = alloc.allocate(need, limit);
  if (!e) {
    finish(r, "nvme_store: no space (ENOSPC, capacity limit): writing page key " +
                  std::to_string(r.key) + " (" + std::to_string(r.bytes) + " bytes) to " + path +
                  " would exceed the capacity " + "limit of " + std::to_string(opt.capacity_bytes) +
                  " bytes (" + std::to_string(alloc.used()) + " bytes of pages in use)");
    return false;
  }
  try {
    grow_file(e->off + e->len, r);
  } catch (const error& ex) {
    alloc.release(*e);
    finish(r, ex.what());
    return false;
  }
  r.offset = e->off;
  pages[r.key] = page_entry{*e, r.bytes, std::move(r.crc)};
  return true;
}

bool nvme_store::impl::prepare_read(request& r) {
  auto it = pages.find(r.key);
  if (it == pages.end()) {
    finish(r, "nvme_store: read of page key " + std::to_string(r.key) + " from " + path +
                  ": no such page");
    return false;
  }
  if (it->second.bytes != r.bytes) {
    finish(r, "nvme_store: read of page key " + std::to_string(r.key) + " from " + path +
                  " asks for " + std::to_string(r.bytes) + " bytes but the page holds " +
                  std::to_string(it->second.bytes));
    return false;
  }
  r.offset = it->second.ext.off;
  return true;
}

void nvme_store::impl::make_ready(request& r) {
  if (!(r.is_write ? prepare_write(r) : prepare_read(r))) return;  // finished with an error
  if (fixed_ok && r.bounce == nullptr) {
    for (std::size_t i = 0; i < regs.size(); ++i) {
      const auto& g = regs[i];
      if (g.p && r.io >= g.p && r.io + r.io_len <= g.p + g.n) {
        r.buf_index = static_cast<int>(i);
        break;
      }
    }
  }
  if (backend == io_backend::pread) {
    run_sync(r);
    return;
  }
  ready.push_back(r.id);
  pump();
}

void nvme_store::impl::run_sync(request& r) {
  while (r.done < r.io_len) {
    ssize_t n = r.is_write ? ::pwrite(fd, r.io + r.done, r.io_len - r.done, r.offset + r.done)
                           : ::pread(fd, r.io + r.done, r.io_len - r.done, r.offset + r.done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int e = n < 0 ? errno : 0;
      finish(r, std::string("nvme_store: ") + (r.is_write ? "pwrite" : "pread") + " of " +
                    where(r, r.offset + r.done) + ", " + std::to_string(r.io_len - r.done) +
                    " bytes failed: " +
                    (n < 0 ? errno_text(e) : (r.is_write ? "short write" : "short read (EOF)")));
      return;
    }
    r.done += static_cast<std::size_t>(n);
  }
  finish(r, "");
}

void nvme_store::impl::pump() {
  bool any = false;
  while (!ready.empty() && submitted < opt.queue_depth) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    if (!sqe) break;
    request& r = requests.at(ready.front());
    ready.pop_front();
    unsigned char* p = r.io + r.done;
    // At most 1 GiB per operation; the rest of a larger page goes as a short transfer would.
    unsigned len = static_cast<unsigned>(std::min<std::size_t>(r.io_len - r.done, 1u << 30));
    std::uint64_t off = r.offset + r.done;
    if (r.buf_index >= 0) {
      if (r.is_write)
        io_uring_prep_write_fixed(sqe, fd, p, len, off, r.buf_index);
      else
        io_uring_prep_read_fixed(sqe, fd, p, len, off, r.buf_index);
    } else if (r.is_write) {
      io_uring_prep_write(sqe, fd, p, len, off);
    } else {
      io_uring_prep_read(sqe, fd, p, len, off);
    }
    io_uring_sqe_set_data64(sqe, r.id);
    ++submitted;
    any = true;
  }
  if (any) flush_sq();
}

// Hands the prepared SQEs to the kernel. The kernel may take fewer than offered (io_uring_submit
// returns how many; EAGAIN/EBUSY: none for now): the rest stay in the SQ ring, and since liburing
// offers everything between the kernel's head and the ring's tail, the next call hands them again.
// Every waiter calls this before it blocks, so no request is left behind in the ring.
void nvme_store::impl::flush_sq() {
  if (io_uring_sq_ready(&ring) == 0) return;
  int rc;
  do {
    if (opt.submit_limit > 0) {  // test knob: what io_uring_submit does, with a smaller count
      ring.sq.sqe_head = ring.sq.sqe_tail;
      io_uring_smp_store_release(ring.sq.ktail, ring.sq.sqe_tail);
      rc = io_uring_enter(ring.ring_fd, std::min(io_uring_sq_ready(&ring), opt.submit_limit), 0, 0,
                          nullptr);
    } else {
      rc = io_uring_submit(&ring);
    }
  } while (rc == -EINTR);
  if (rc == -EAGAIN || rc == -EBUSY) return;  // kernel resources short: again after completions
  if (rc < 0) TROUPE_FAIL("nvme_store: io_uring_submit on ", path, " failed: ", errno_text(-rc));
}

// SQEs the kernel has taken and not yet completed (reaped).
unsigned nvme_store::impl::in_kernel() const {
  return submitted - io_uring_sq_ready(&ring);
}

// Consumes the completions already posted (never blocks). Only the reaper may run it while one
// is blocked in io_uring_wait_cqe: a completion taken from under it would leave it asleep.
std::size_t nvme_store::impl::reap_ready() {
  std::size_t n = 0;
  io_uring_cqe* cqes[64];
  for (;;) {
    unsigned got = io_uring_peek_batch_cqe(&ring, cqes, 64);
    if (got == 0) break;
    for (unsigned i = 0; i < got; ++i) {
      std::uint64_t id = io_uring_cqe_get_data64(cqes[i]);
      int res = cqes[i]->res;
      io_uring_cqe_seen(&ring, cqes[i]);
      --submitted;
      on_cqe(id, res);
      ++n;
    }
  }
  pump();
  return n;
}

// Progress without blocking (test, poll): hand queued SQEs, reap what is posted, unless a
// blocked waiter is reaping (it wakes on the next completion and reaps then).
std::size_t nvme_store::impl::poll_ring() {
  if (!ring_ok || reaping) return 0;
  flush_sq();
  return reap_ready();
}

// Blocks until done() (called under m). One waiter at a time sleeps in io_uring_wait_cqe with m
// released; the others wait on `reaped` and re-check when it comes back.
template <class Done>
void nvme_store::impl::wait_until(std::unique_lock<std::mutex>& lk, Done done) {
  while (!done()) {
    TROUPE_CHECK(ring_ok && submitted > 0, "nvme_store: internal error on ", path,
                 ": waiting for a request that is not in flight");
    if (reaping) {
      reaped.wait(lk);
      continue;
    }
    flush_sq();
    if (reap_ready() > 0) continue;
    if (in_kernel() == 0) {  // the kernel took none of the queued SQEs yet (EAGAIN): retry
      lk.unlock();
      std::this_thread::yield();
      lk.lock();
      continue;
    }
    reaping = true;
    lk.unlock();
    if (opt.on_block) opt.on_block();
    io_uring_cqe* cqe = nullptr;
    int rc;
    do rc = io_uring_wait_cqe(&ring, &cqe);
    while (rc == -EINTR || rc == -EAGAIN);
    lk.lock();
    reaping = false;
    reaped.notify_all();
    if (rc < 0)
      TROUPE_FAIL("nvme_store: io_uring_wait_cqe on ", path, " failed: ", errno_text(-rc));
    reap_ready();
  }
}

void nvme_store::impl::on_cqe(std::uint64_t id, int res) {
  request& r = requests.at(id);
  const char* op = r.is_write ? "write" : "read";
  if (res < 0) {
    finish(r, std::string("nvme_store: io_uring ") + op + " of " + where(r, r.offset + r.done) +
                  ", " + std::to_string(r.io_len - r.done) + " bytes failed: " + errno_text(-res));
    return;
  }
  if (res == 0) {
    finish(r, std::string("nvme_store: io_uring ") + op + " of " + where(r, r.offset + r.done) +
                  ": " + (r.is_write ? "short write (0 bytes)" : "short read (EOF)"));
    return;
  }
  r.done += static_cast<std::size_t>(res);
  if (r.done < r.io_len) {  // short transfer: resubmit the rest first
    ready.push_front(r.id);
    return;
  }
  finish(r, "");
}

void nvme_store::impl::verify(request& r) {
  const page_entry& pg = pages.at(r.key);
  std::size_t blocks = r.io_len / nvme_block;
  std::vector<std::uint32_t> got(blocks);
  crc32c_blocks(r.io, nvme_block, blocks, got.data());
  for (std::size_t b = 0; b < blocks; ++b) {
    if (got[b] != pg.crc[b]) {
      ++st.checksum_errors;
      r.error = "nvme_store: checksum mismatch (torn or corrupted page) reading " +
                where(r, r.offset + b * nvme_block) + " (block " + std::to_string(b) + " of " +
                std::to_string(blocks) + ")";
      return;
    }
  }
}

void nvme_store::impl::finish(request& r, std::string err) {
  r.error = std::move(err);
  if (r.error.empty() && !r.is_write) {
    verify(r);
    if (r.error.empty() && r.bounce) std::memcpy(r.user, r.io, r.bytes);
  }
  if (!r.error.empty() && r.is_write) {  // a failed write drops the page
    if (auto it = pages.find(r.key);
        it != pages.end() && it->second.ext.off == r.offset && r.offset != 0) {
      alloc.release(it->second.ext);
      pages.erase(it);
    }
  }
  r.bounce.reset();
  r.finished = true;
  --unfinished;
  ++completed;
  if (r.is_write) {
    ++st.writes;
    if (r.error.empty()) st.bytes_written += r.bytes;
    write_busy.stop();
  } else {
    ++st.reads;
    if (r.error.empty()) st.bytes_read += r.bytes;
    read_busy.stop();
  }
  if (!r.error.empty()) ++st.failed;

  std::uint64_t key = r.key, id = r.id;
  if (r.detached) requests.erase(id);  // r is gone from here on
  auto qit = key_queue.find(key);
  auto& q = qit->second;
  q.pop_front();  // the front is always the request that finished
  if (q.empty()) {
    key_queue.erase(qit);
    return;
  }
  make_ready(requests.at(q.front()));
}

void nvme_store::impl::wait_id(std::unique_lock<std::mutex>& lk, std::uint64_t id) {
  wait_until(lk, [&] {
    auto it = requests.find(id);
    return it == requests.end() || it->second.finished;
  });
}

void nvme_store::impl::drain(std::unique_lock<std::mutex>& lk) {
  wait_until(lk, [&] { return unfinished == 0; });
}

// ---------------------------------------------------------------- tickets

void nvme_store::ticket_release(std::uint64_t id) noexcept {
  auto& s = *impl_;
  std::unique_lock lk(s.m);
  try {
    s.wait_id(lk, id);
  } catch (...) {  // the ring itself failed; the request stays detached
  }
  auto it = s.requests.find(id);
  if (it != s.requests.end()) {
    if (it->second.finished)
      s.requests.erase(it);
    else
      it->second.detached = true;
  }
}

void nvme_store::ticket_wait(std::uint64_t id) {
  auto& s = *impl_;
  std::unique_lock lk(s.m);
  s.wait_id(lk, id);
  auto it = s.requests.find(id);
  std::string err = std::move(it->second.error);
  s.requests.erase(it);
  if (!err.empty()) throw error(err);
}

bool nvme_store::ticket_test(std::uint64_t id) {
  auto& s = *impl_;
  std::unique_lock lk(s.m);
  s.poll_ring();
  return s.requests.at(id).finished;
}

// ---------------------------------------------------------------- nvme_store

nvme_store::nvme_store(nvme_store_options options) : impl_(std::make_unique<impl>()) {
  impl_->opt = std::move(options);
  TROUPE_CHECK(impl_->opt.capacity_bytes == 0 || impl_->opt.capacity_bytes > header_bytes,
               "nvme_store: options.capacity_bytes (", impl_->opt.capacity_bytes,
               ") must be 0 or more than ", header_bytes);
  impl_->open_file();
  try {
    impl_->choose_backend();
  } catch (...) {
    ::close(impl_->fd);
    if (impl_->opt.remove_on_close) ::unlink(impl_->path.c_str());
    throw;
  }
}

nvme_store::~nvme_store() {
  auto& s = *impl_;
  {
    std::unique_lock lk(s.m);
    try {
      s.drain(lk);
    } catch (...) {  // destructors do not throw; the ring is torn down below anyway
    }
  }
  if (s.ring_ok) io_uring_queue_exit(&s.ring);
  if (s.fd >= 0) ::close(s.fd);
  if (s.opt.remove_on_close) ::unlink(s.path.c_str());
}

io_ticket nvme_store::write(std::uint64_t key, const void* p, std::size_t n) {
  TROUPE_CHECK(p != nullptr || n == 0, "nvme_store::write: null buffer for page key ", key);
  TROUPE_CHECK(n > 0, "nvme_store::write: empty page for key ", key, " in ", impl_->path);
  request r;
  r.key = key;
  r.is_write = true;
  r.user = static_cast<unsigned char*>(const_cast<void*>(p));
  r.bytes = n;
  r.io_len = round_up(n);
  if (aligned(p) && n % nvme_block == 0) {
    r.io = r.user;
  } else {  // bounce: copy in, zero the tail of the last block
    r.bounce = alloc_bounce(r.io_len);
    std::memcpy(r.bounce.get(), p, n);
    std::memset(r.bounce.get() + n, 0, r.io_len - n);
    r.io = r.bounce.get();
  }
  r.crc.resize(r.io_len / nvme_block);
  crc32c_blocks(r.io, nvme_block, r.crc.size(), r.crc.data());  // outside the lock
  std::unique_lock lk(impl_->m);
  return make_ticket(impl_->issue(std::move(r)));
}

io_ticket nvme_store::read(std::uint64_t key, void* p, std::size_t n) {
  TROUPE_CHECK(p != nullptr && n > 0, "nvme_store::read: empty buffer for page key ", key);
  request r;
  r.key = key;
  r.user = static_cast<unsigned char*>(p);
  r.bytes = n;
  r.io_len = round_up(n);
  if (aligned(p) && n % nvme_block == 0) {
    r.io = r.user;
  } else {
    r.bounce = alloc_bounce(r.io_len);
    r.io = r.bounce.get();
  }
  std::unique_lock lk(impl_->m);
  return make_ticket(impl_->issue(std::move(r)));
}

void nvme_store::erase(std::uint64_t key) {
  auto& s = *impl_;
  std::unique_lock lk(s.m);
  s.wait_until(lk, [&] { return s.key_queue.count(key) == 0; });
  if (auto it = s.pages.find(key); it != s.pages.end()) {
    s.alloc.release(it->second.ext);
    s.pages.erase(it);
  }
}

void nvme_store::register_buffer(void* p, std::size_t n) {
  auto& s = *impl_;
  TROUPE_CHECK(aligned(p) && n % nvme_block == 0 && n > 0, "nvme_store::register_buffer: buffer ",
               p, " of ", n, " bytes is not 4 KiB aligned in address and size");
  std::unique_lock lk(s.m);
  if (!s.fixed_ok) return;
  for (std::size_t i = 0; i < s.regs.size(); ++i) {
    if (s.regs[i].p) continue;
    iovec iov{p, n};
    int rc =
        io_uring_register_buffers_update_tag(&s.ring, static_cast<unsigned>(i), &iov, nullptr, 1);
    TROUPE_CHECK(rc >= 0, "nvme_store::register_buffer on ", s.path, ": ", errno_text(-rc));
    s.regs[i] = {static_cast<unsigned char*>(p), n};
    return;
  }
  TROUPE_FAIL("nvme_store::register_buffer: all ", max_registrations, " slots of ", s.path,
              " are in use");
}

void nvme_store::unregister_buffer(void* p) {
  auto& s = *impl_;
  std::unique_lock lk(s.m);
  if (!s.fixed_ok) return;
  for (std::size_t i = 0; i < s.regs.size(); ++i) {
    if (s.regs[i].p != p) continue;
    s.drain(lk);
    iovec iov{nullptr, 0};
    int rc =
        io_uring_register_buffers_update_tag(&s.ring, static_cast<unsigned>(i), &iov, nullptr, 1);
    TROUPE_CHECK(rc >= 0, "nvme_store::unregister_buffer on ", s.path, ": ", errno_text(-rc));
    s.regs[i] = {};
    return;
  }
  TROUPE_FAIL("nvme_store::unregister_buffer: ", static_cast<void*>(p), " is not registered with ",
              s.path);
}

void nvme_store::wait_all() {
  std::unique_lock lk(impl_->m);
  impl_->drain(lk);
}

std::size_t nvme_store::poll() {
  std::unique_lock lk(impl_->m);
  return impl_->poll_ring();
}

std::uint64_t nvme_store::wait_progress(std::uint64_t seen) {
  auto& s = *impl_;
  std::unique_lock lk(s.m);
  s.wait_until(lk, [&] { return s.completed > seen || s.unfinished == 0; });
  return s.completed;
}

std::size_t nvme_store::in_flight() const {
  std::unique_lock lk(impl_->m);
  return impl_->unfinished;
}

bool nvme_store::contains(std::uint64_t key) const {
  std::unique_lock lk(impl_->m);
  return impl_->pages.count(key) > 0;
}

std::size_t nvme_store::page_bytes(std::uint64_t key) const {
  std::unique_lock lk(impl_->m);
  auto it = impl_->pages.find(key);
  return it == impl_->pages.end() ? 0 : it->second.bytes;
}

std::uint64_t nvme_store::page_offset(std::uint64_t key) const {
  std::unique_lock lk(impl_->m);
  auto it = impl_->pages.find(key);
  TROUPE_CHECK(it != impl_->pages.end(), "nvme_store::page_offset: no page with key ", key, " in ",
               impl_->path);
  return it->second.ext.off;
}

std::size_t nvme_store::pages() const {
  std::unique_lock lk(impl_->m);
  return impl_->pages.size();
}

std::uint64_t nvme_store::used_bytes() const {
  std::unique_lock lk(impl_->m);
  return impl_->alloc.used();
}

std::uint64_t nvme_store::file_bytes() const {
  std::unique_lock lk(impl_->m);
  return impl_->file_size;
}

io_backend nvme_store::backend() const {
  return impl_->backend;
}
bool nvme_store::direct_io() const {
  return impl_->direct;
}
std::string nvme_store::backend_note() const {
  return impl_->note;
}
std::string nvme_store::path() const {
  return impl_->path;
}
unsigned nvme_store::queue_depth() const {
  return impl_->opt.queue_depth;
}

nvme_stats nvme_store::stats() const {
  std::unique_lock lk(impl_->m);
  nvme_stats s = impl_->st;
  s.read_busy_s = impl_->read_busy.now_seconds();
  s.write_busy_s = impl_->write_busy.now_seconds();
  return s;
}

void nvme_store::reset_stats() {
  std::unique_lock lk(impl_->m);
  impl_->st = {};
  impl_->read_busy.seconds = 0;
  impl_->write_busy.seconds = 0;
  if (impl_->read_busy.active) impl_->read_busy.since = clock_type::now();
  if (impl_->write_busy.active) impl_->write_busy.since = clock_type::now();
}

}  // namespace troupe::memory::io
