// nvme_store: the NVMe tier's I/O engine. Pages (byte blocks keyed by a 64-bit id, a chunk's id)
// live in ONE file per store, `<dir>/<name>.pages`, at 4 KiB-aligned extents handed out by a
// first-fit allocator (one file, not one file per page: no open/close/unlink per page, one
// fallocate'd region, and registered buffers and O_DIRECT apply to every page the same way).
//
// Contract:
// - write(key, p, n) and read(key, p, n) return an io_ticket at once; the I/O proceeds
//   asynchronously (io_uring, up to queue_depth requests in flight, completion driven: completions
//   are reaped by whoever calls wait/test/poll; there is no I/O thread). The caller's buffer must
//   stay valid and untouched until the ticket completes. Requests on the same key run in the order
//   issued (a read issued after a write sees that write); requests on different keys overlap.
// - Buffers that are 4 KiB aligned with a size that is a multiple of 4 KiB go straight to the disk
//   (O_DIRECT); anything else goes through an internal aligned bounce buffer. A buffer registered
//   with register_buffer() uses io_uring fixed-buffer operations.
// - Every 4 KiB block written gets a CRC32C in an in-memory side table; reads verify them. A
//   mismatch (a torn or corrupted page) fails the read with a message naming the file, the key and
//   the file offset of the bad block.
// - Errors (no space: ENOSPC or the capacity limit, short writes, EIO, checksum mismatch) fail only
//   the request concerned: its ticket's wait() throws troupe::error naming the path, the operation
//   and the key. Pages written before stay readable. A failed write drops that key's page.
// - Backends: io_uring, or plain pread/pwrite when io_uring_queue_init is refused (EPERM under
//   seccomp, ENOSYS, io_uring_disabled) or forced (options.backend or env
//   TROUPE_NVME_BACKEND=pread). The pread backend does the I/O inside write()/read()
//   (synchronously). backend() reports which is in use and backend_note() why.
// - O_DIRECT refused by the file system (EINVAL at open or on the probe write of the header block):
//   the store falls back to buffered I/O and says so in backend_note(); direct_io() reports it.
// - The store is scratch space for one process: the file is created (truncated) when the store
//   opens and removed when it closes (options.remove_on_close). The page table lives in memory.
// - Thread safe (one internal mutex; a waiter blocks in io_uring_wait_cqe holding it). The
//   destructor waits for all in-flight I/O; tickets must not outlive their store.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace troupe::memory::io {

inline constexpr std::size_t nvme_block = 4096;  // alignment of offsets, sizes and direct buffers

enum class io_backend : std::uint8_t { io_uring, pread };
std::string_view backend_name(io_backend b);  // "io_uring" / "pread"

struct nvme_store_options {
  std::string dir;                    // directory of the store's file; created if missing
  std::string name = "troupe_nvme";   // file is <dir>/<name>.pages
  unsigned queue_depth = 8;           // most requests in flight at once (io_uring backend)
  std::uint64_t capacity_bytes = 0;   // limit on the file's size; 0 = only the disk's size
  std::optional<io_backend> backend;  // force a backend; unset = io_uring, else the env var
  bool direct = true;                 // O_DIRECT (falls back to buffered I/O when refused)
  bool remove_on_close = true;        // unlink the file when the store closes
};

struct nvme_stats {
  std::uint64_t bytes_read = 0;     // bytes delivered to callers by successful reads
  std::uint64_t bytes_written = 0;  // bytes of successful writes
  std::uint64_t reads = 0;          // completed read requests (ok or failed)
  std::uint64_t writes = 0;         // completed write requests (ok or failed)
  std::uint64_t failed = 0;         // requests that ended in an error
  std::uint64_t checksum_errors = 0;
  double read_busy_s = 0;   // wall time during which at least one read was in flight
  double write_busy_s = 0;  // wall time during which at least one write was in flight
  double read_gbps() const { return read_busy_s > 0 ? bytes_read / read_busy_s / 1e9 : 0; }
  double write_gbps() const { return write_busy_s > 0 ? bytes_written / write_busy_s / 1e9 : 0; }
};

class nvme_store;

// A handle on one request. Move-only. wait() blocks until the request is done and throws
// troupe::error if it failed; test() makes progress without blocking and says whether it is done
// (it never throws for the request's own failure: wait() reports that). Destroying an unfinished
// ticket waits for the request (a failure then shows only in stats().failed).
class io_ticket {
 public:
  io_ticket() = default;
  io_ticket(io_ticket&& o) noexcept;
  io_ticket& operator=(io_ticket&& o) noexcept;
  io_ticket(const io_ticket&) = delete;
  io_ticket& operator=(const io_ticket&) = delete;
  ~io_ticket();

  void wait();
  bool test();
  bool valid() const { return store_ != nullptr; }

 private:
  friend class nvme_store;
  io_ticket(nvme_store* s, std::uint64_t id) : store_(s), id_(id) {}
  void release() noexcept;
  nvme_store* store_ = nullptr;
  std::uint64_t id_ = 0;
};

class nvme_store {
 public:
  explicit nvme_store(nvme_store_options options);  // throws troupe::error naming the path
  ~nvme_store();
  nvme_store(const nvme_store&) = delete;
  nvme_store& operator=(const nvme_store&) = delete;

  // Store n bytes from p as the page `key` (replacing any earlier page of that key).
  io_ticket write(std::uint64_t key, const void* p, std::size_t n);
  // Read the page `key` into p; n must equal the page's size (page_bytes(key)).
  io_ticket read(std::uint64_t key, void* p, std::size_t n);
  // Drop a page and free its extent (waits for that key's requests first).
  void erase(std::uint64_t key);

  // Register a caller buffer (p 4 KiB aligned, n a multiple of 4 KiB) for fixed-buffer I/O; any
  // request whose bytes lie inside it then uses it. A no-op on the pread backend. Unregister
  // waits for in-flight requests first. At most 1024 registrations.
  void register_buffer(void* p, std::size_t n);
  void unregister_buffer(void* p);

  void wait_all();                // wait for every request issued so far (does not throw)
  std::size_t poll();             // reap completions and submit queued requests; returns # reaped
  std::size_t in_flight() const;  // requests issued and not yet completed

  bool contains(std::uint64_t key) const;
  std::size_t page_bytes(std::uint64_t key) const;     // 0 if absent
  std::uint64_t page_offset(std::uint64_t key) const;  // file offset of the page (tests, tools)
  std::size_t pages() const;
  std::uint64_t used_bytes() const;  // bytes of extents in use (4 KiB rounded)
  std::uint64_t file_bytes() const;  // current size of the file

  io_backend backend() const;
  bool direct_io() const;
  const std::string& backend_note() const;  // why this backend / buffered mode ("" if default)
  const std::string& path() const;
  unsigned queue_depth() const;

  nvme_stats stats() const;
  void reset_stats();

  struct impl;  // private; in nvme_store.cpp

 private:
  friend class io_ticket;
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::memory::io
