// page_io: the interface of the NVMe tier's page I/O, so that its user (memory::tier_manager)
// need not know whether the pages go to an nvme_store in the same thread or through the NVMe
// actor (actors/nvme_actor.hpp, a client over CAF messages).
//
// Contract (every implementation):
// - write(key, p, n) and read(key, p, n) return an io_ticket at once; the bytes move later. The
//   caller's buffer stays valid and untouched until the ticket completes. Requests on one key run
//   in the order issued; requests on different keys may overlap. read() asks for exactly the size
//   written.
// - io_ticket::wait() blocks until the request is done and throws troupe::error naming the path,
//   the key (and the file offset where it applies) when it failed; test() never blocks nor throws
//   for the request's own failure. Destroying an unfinished ticket waits for its request.
// - remove(key) drops a page (after that key's requests); wait_all() waits for every request.
// - stats() counts completed requests and bytes; backend(), direct_io() and path() say how and
//   where the pages are stored.
// Tickets must not outlive the page_io that made them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace troupe::memory::io {

inline constexpr std::size_t nvme_block = 4096;  // alignment of offsets, sizes and direct buffers

enum class io_backend : std::uint8_t { io_uring, pread };
std::string_view backend_name(io_backend b);  // "io_uring" / "pread"

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

class page_io;

// A handle on one request of a page_io. Move-only; see the contract above.
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
  bool valid() const { return owner_ != nullptr; }

 private:
  friend class page_io;
  io_ticket(page_io* owner, std::uint64_t id) : owner_(owner), id_(id) {}
  void release() noexcept;
  page_io* owner_ = nullptr;
  std::uint64_t id_ = 0;
};

class page_io {
 public:
  virtual ~page_io() = default;

  virtual io_ticket write(std::uint64_t key, const void* p, std::size_t n) = 0;
  virtual io_ticket read(std::uint64_t key, void* p, std::size_t n) = 0;
  virtual void remove(std::uint64_t key) = 0;
  virtual void wait_all() = 0;  // does not throw

  virtual std::uint64_t used_bytes() const = 0;  // bytes of pages stored (4 KiB rounded)
  virtual nvme_stats stats() const = 0;
  virtual void reset_stats() = 0;
  virtual io_backend backend() const = 0;
  virtual bool direct_io() const = 0;
  virtual std::string path() const = 0;          // the file the pages live in
  virtual std::string backend_note() const = 0;  // why this backend / buffered ("" if default)
  // "io_uring, O_DIRECT, <path>" (+ the backend note when there is one): for banners and logs.
  std::string describe_backend() const;

 protected:
  io_ticket make_ticket(std::uint64_t id) { return io_ticket(this, id); }
  // The ticket operations, by the id make_ticket was given.
  virtual void ticket_wait(std::uint64_t id) = 0;              // throws the request's error
  virtual bool ticket_test(std::uint64_t id) = 0;              // done yet? (never throws for it)
  virtual void ticket_release(std::uint64_t id) noexcept = 0;  // waits; forgets the request

 private:
  friend class io_ticket;
};

}  // namespace troupe::memory::io
