// nvme_store: the NVMe tier's I/O engine. Pages (byte blocks keyed by a 64-bit id, a chunk's id)
// live in ONE file per store, `<dir>/<name>.pages`, at 4 KiB-aligned extents handed out by a
// first-fit allocator (one file, not one file per page: no open/close/unlink per page, one
// fallocate'd region, and registered buffers and O_DIRECT apply to every page the same way).
//
// Contract:
// - write(key, p, n) and read(key, p, n) return an io_ticket at once; the I/O proceeds
//   asynchronously (io_uring, up to queue_depth requests in flight, completion driven: completions
//   are reaped by whoever calls wait/test/poll, or by the waiter asleep in the kernel when there is
//   one; there is no I/O thread). The caller's buffer must
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
// - Thread safe: one internal mutex, never held while blocked in the kernel. One waiter at a time
//   blocks in io_uring_wait_cqe without the lock (the others wait on a condition variable), so
//   other threads issue and test requests meanwhile. SQEs the kernel does not take at once
//   (io_uring_submit may submit fewer than prepared) stay queued and are handed again before
//   anyone waits. The destructor waits for all in-flight I/O; tickets must not outlive their
//   store.
// - Implements page_io (page_io.hpp): the interface memory::tier_manager and the NVMe actor use.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "memory/io/page_io.hpp"

namespace troupe::memory::io {

struct nvme_store_options {
  std::string dir;                    // directory of the store's file; created if missing
  std::string name = "troupe_nvme";   // file is <dir>/<name>.pages
  unsigned queue_depth = 8;           // most requests in flight at once (io_uring backend)
  std::uint64_t capacity_bytes = 0;   // limit on the file's size; 0 = only the disk's size
  std::optional<io_backend> backend;  // force a backend; unset = io_uring, else the env var
  bool direct = true;                 // O_DIRECT (falls back to buffered I/O when refused)
  bool remove_on_close = true;        // unlink the file when the store closes
  // For tests and tracing. submit_limit: the most SQEs handed to the kernel per io_uring_enter
  // (0: all), as a kernel that takes fewer than offered would. on_block: called, without the
  // store's lock, each time a waiter is about to block in io_uring_wait_cqe.
  unsigned submit_limit = 0;
  std::function<void()> on_block;
};

class nvme_store final : public page_io {
 public:
  explicit nvme_store(nvme_store_options options);  // throws troupe::error naming the path
  ~nvme_store() override;
  nvme_store(const nvme_store&) = delete;
  nvme_store& operator=(const nvme_store&) = delete;

  // Store n bytes from p as the page `key` (replacing any earlier page of that key).
  io_ticket write(std::uint64_t key, const void* p, std::size_t n) override;
  // Read the page `key` into p; n must equal the page's size (page_bytes(key)).
  io_ticket read(std::uint64_t key, void* p, std::size_t n) override;
  // Drop a page and free its extent (waits for that key's requests first).
  void erase(std::uint64_t key);
  void remove(std::uint64_t key) override { erase(key); }

  // Register a caller buffer (p 4 KiB aligned, n a multiple of 4 KiB) for fixed-buffer I/O; any
  // request whose bytes lie inside it then uses it. A no-op on the pread backend. Unregister
  // waits for in-flight requests first. At most 1024 registrations.
  void register_buffer(void* p, std::size_t n);
  void unregister_buffer(void* p);

  void wait_all() override;       // wait for every request issued so far (does not throw)
  std::size_t poll();             // reap completions and submit queued requests; returns # reaped
  std::size_t in_flight() const;  // requests issued and not yet completed
  // Blocks until more than `seen` requests have completed since the store opened, or none is in
  // flight; returns how many have completed. For an I/O loop that reaps on behalf of others (the
  // NVMe actor's reaper thread): it never misses a completion between two calls.
  std::uint64_t wait_progress(std::uint64_t seen);

  bool contains(std::uint64_t key) const;
  std::size_t page_bytes(std::uint64_t key) const;     // 0 if absent
  std::uint64_t page_offset(std::uint64_t key) const;  // file offset of the page (tests, tools)
  std::size_t pages() const;
  std::uint64_t used_bytes() const override;  // bytes of extents in use (4 KiB rounded)
  std::uint64_t file_bytes() const;           // current size of the file

  io_backend backend() const override;
  bool direct_io() const override;
  std::string backend_note() const override;  // why this backend / buffered mode ("" if default)
  std::string path() const override;
  unsigned queue_depth() const;

  nvme_stats stats() const override;
  void reset_stats() override;

  struct impl;  // private; in nvme_store.cpp

 private:
  void ticket_wait(std::uint64_t id) override;
  bool ticket_test(std::uint64_t id) override;
  void ticket_release(std::uint64_t id) noexcept override;
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::memory::io
