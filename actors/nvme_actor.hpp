// nvme_actor: the NVMe actor. It owns a memory::io::nvme_store (io_uring with O_DIRECT, 4 KiB
// alignment, registered buffers, several requests in flight; pread/pwrite where io_uring is
// refused; CRC32C per block) and serves page requests as CAF messages. Buffers travel as
// pointers, so clients live in the same process.
//
// Contract:
// - A write/read request is answered when its I/O completes, with the page's byte count, or with
//   a CAF error (sec::runtime_error) whose context is the store's message: the path, the
//   operation, the key and the file offset (a checksum mismatch, ENOSPC or the capacity limit,
//   EIO). An error fails only its request; later requests work.
// - Many requests are in flight at once: the actor issues each to the store and returns to its
//   mailbox; a reaper thread sleeps in the kernel (nvme_store::wait_progress) and messages the
//   actor when requests complete, and the actor answers them. remove(key) waits for that key's
//   requests inside the actor (short: they are already issued).
// - client() is a memory::io::page_io whose requests are messages to the actor (through a small
//   forwarding actor per client), so memory::tier_manager runs its NVMe tier through the actor
//   (tier_manager_options::nvme_io). Tickets of a client complete when the actor answers.
// - Introspection: metrics() ("nvme.bytes_read", "nvme.bytes_written", "nvme.in_flight",
//   "nvme.read_gbps", "nvme.write_gbps", "nvme.io_uring", "nvme.o_direct", "nvme.failed",
//   "nvme.checksum_errors", "nvme.used_bytes") and describe() ("io_uring, O_DIRECT, <file>").
//   As the "nvme" role (add_nvme_role) they are its actor_state metrics and activity, so
//   `describe`, `troupe ps` and `troupe top` show them.
// - The destructor waits for the requests in flight, stops the actor, then closes the store.
//   Clients may outlive it: their later requests fail naming the stopped actor.
//
//   actors::nvme_actor nvme(store_options);               // an actor system of its own
//   auto io = nvme.client();
//   io->write(7, page, bytes).wait();
//
//   In a job: add_nvme_role(roles); h = job.spawn(nvme_role, rank); job.ask<std::string>(h,
//   nvme_open{...}); then on that rank nvme_client(node, h) is the page_io.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>

#include "actors/roles.hpp"
#include "memory/io/nvme_store.hpp"
#include "memory/io/page_io.hpp"

namespace troupe::actors {

class nvme_actor {
 public:
  // On the node's actor system.
  nvme_actor(node& n, memory::io::nvme_store_options o);
  // On an actor system of its own (benches and tools without a job).
  explicit nvme_actor(memory::io::nvme_store_options o);
  ~nvme_actor();
  nvme_actor(const nvme_actor&) = delete;
  nvme_actor& operator=(const nvme_actor&) = delete;

  std::shared_ptr<memory::io::page_io> client();
  std::map<std::string, double> metrics() const;
  std::string describe() const;
  const memory::io::nvme_store& store() const;
  // Fixed-buffer I/O for a caller's pinned buffer (nvme_store::register_buffer; thread safe).
  void register_buffer(void* p, std::size_t n);
  void unregister_buffer(void* p);
  // Called (on the actor's thread) with metrics() after requests complete.
  void on_metrics(std::function<void(const std::map<std::string, double>&)> f);

  struct impl;

 private:
  std::shared_ptr<impl> impl_;
};

inline constexpr const char* nvme_role = "nvme";

// Opens the store of an "nvme" role actor (again: replaces it). Reply: describe().
struct nvme_open {
  std::string dir;
  std::string name = "troupe_nvme";
  std::uint64_t queue_depth = 8;
  std::uint64_t capacity_bytes = 0;
  std::string backend;  // "" (io_uring unless TROUPE_NVME_BACKEND says), "io_uring" or "pread"
  bool direct = true;
  auto fields() { return std::tie(dir, name, queue_depth, capacity_bytes, backend, direct); }
};
// Asks for metrics() (std::map<std::string, double>).
struct nvme_numbers_request {
  std::uint8_t unused = 0;
};

// Registers the "nvme" role: nvme_open, nvme_numbers_request; its metrics and activity follow the
// store. A no-op when the registry has it already.
void add_nvme_role(role_registry& roles);
// The page_io of the "nvme" role actor `h`, which must run in this process (h.rank == n.rank())
// and be opened. Throws troupe::error naming the actor otherwise.
std::shared_ptr<memory::io::page_io> nvme_client(node& n, const role_handle& h);

}  // namespace troupe::actors
