// tier_manager: where each chunk's bytes live (device, host, NVMe) under per-tier budgets, with
// prefetch along a known schedule and Belady eviction (ZeRO-Infinity / Colossal-AI Gemini style).
//
// A chunk (memory/chunk.hpp) is registered with a size and a HOME tier: device or host (a buffer
// there for its whole life) or nvme (a page in a memory/io nvme_store). A chunk is used by
// acquire(chunk, where) in the device or host tier, which returns its bytes there and pins them
// until release(); a chunk used outside its home tier is copied into a SLOT of that tier's cache
// (a pool of chunk-sized slots: the budget left after the homes and the reserved non-model bytes).
// release(dirty = true) makes that copy the only current one; a copy that is the only current one
// is written back to the home when its slot is evicted (NVMe: through nvme_store, checksummed).
//
// The schedule: set_schedule() gives the order in which (chunk, tier) uses will come (for a
// training step: the forward order, backward in reverse, then the optimizer's order; it repeats
// each step). Each acquire advances a cursor along it. A full cache evicts the unpinned chunk
// whose next use is furthest ahead (Belady's MIN with the known schedule, wrapping into the next
// step), and after each acquire the next `prefetch_depth` uses are fetched ahead when a free slot,
// or a victim needed later than they are, exists. NVMe reads are asynchronous (a chunk being read
// is "in flight"); host <-> device copies are synchronous.
//
// The device tier: this version keeps it as an accounted, capped region of host memory (the
// whole mechanism runs on machines without a GPU; compute on a real GPU is future work). Budgets
// are exact: homes + slots + reserved never exceed them, or the constructor of the pools (the
// first acquire) throws naming the budget. Not thread safe: one owner drives it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "memory/tier.hpp"

namespace troupe::memory {
namespace io {
class page_io;
}

enum class chunk_state : std::uint8_t { resident, in_flight, evicted };
std::string_view chunk_state_name(chunk_state s);

struct chunk_use {
  std::int32_t chunk = 0;
  tier where = tier::device;  // device or host
  bool operator==(const chunk_use&) const = default;
};

struct tier_manager_options {
  std::size_t device_bytes = 0;  // the device budget
  std::size_t host_bytes = 0;    // the host budget (0: unlimited)
  std::string nvme_dir;          // the NVMe tier's directory ("": no NVMe tier)
  int prefetch_depth = 4;        // schedule uses looked ahead after each acquire (0: none)
  // A limit on the NVMe tier's file (0: the disk's size); a write past it fails naming the file.
  std::uint64_t nvme_capacity_bytes = 0;
  // The NVMe tier's page I/O (e.g. the NVMe actor's client, actors/nvme_actor.hpp); null: an
  // io::nvme_store of the manager's own in nvme_dir. Given, it is the NVMe tier (nvme_dir unused).
  std::shared_ptr<io::page_io> nvme_io = nullptr;
};

// The visible numbers (actor_state metrics of the tier-manager actor).
struct tier_report {
  std::size_t device_budget = 0, device_used = 0, device_peak = 0;  // homes + slots + reserved
  std::size_t host_budget = 0, host_used = 0;                       // (0 budget: unlimited)
  std::uint64_t nvme_bytes = 0;    // bytes of chunk pages stored on NVMe
  std::int32_t chunks = 0;         // registered
  std::int32_t chunks_device = 0;  // chunks with a current copy in the device tier
  std::int32_t chunks_host = 0;    // ... in the host tier
  std::int32_t chunks_nvme = 0;    // ... on NVMe
  std::int32_t in_flight = 0;      // NVMe reads under way
  std::uint64_t acquires = 0;      // of chunks outside their home tier
  std::uint64_t hits = 0;          // of those, found resident or in flight (prefetched)
  std::uint64_t prefetches = 0, evictions = 0, writebacks = 0;
  std::uint64_t bytes_moved = 0;  // host <-> device and NVMe bytes, both ways
  std::uint64_t nvme_read_bytes = 0, nvme_write_bytes = 0;
  double io_seconds = 0;  // time spent copying and waiting on NVMe
  double hit_rate() const { return acquires ? static_cast<double>(hits) / acquires : 1.0; }
  double io_gbps() const { return io_seconds > 0 ? bytes_moved / io_seconds / 1e9 : 0.0; }
};

class tier_manager {
 public:
  explicit tier_manager(const tier_manager_options& opt);
  ~tier_manager();
  tier_manager(const tier_manager&) = delete;
  tier_manager& operator=(const tier_manager&) = delete;
  tier_manager(tier_manager&&) noexcept;
  tier_manager& operator=(tier_manager&&) noexcept;

  // Registers a chunk of `bytes` (zero-filled) whose home is device, host or nvme; returns its
  // id (0, 1, ...). Chunks and reservations are fixed before the first acquire.
  std::int32_t add_chunk(std::size_t bytes, tier home, std::string_view label = {});
  // Non-model bytes the owner uses in a tier (activations, scratch): taken off the budget.
  void reserve(tier where, std::size_t bytes);
  // The schedule; set it before the first acquire so the pools hold only the slots it uses.
  void set_schedule(std::vector<chunk_use> uses);
  // Back to the schedule's start (after acquires off the schedule, e.g. loading weights).
  void rewind();

  // The chunk's bytes in `where` (device or host), pinned until release. discard: the caller
  // overwrites every byte, so nothing is fetched.
  std::byte* acquire(std::int32_t chunk, tier where, bool discard = false);
  void release(std::int32_t chunk, tier where, bool dirty);

  // Writes every copy that is the only current one back to its home and empties the caches.
  void flush();

  chunk_state state(std::int32_t chunk, tier where) const;
  tier home(std::int32_t chunk) const;
  std::size_t chunk_bytes(std::int32_t chunk) const;
  std::int32_t chunks() const;
  std::size_t slots(tier where) const;  // cache slots of a tier (after the first acquire)
  tier_report report() const;
  // Chunks evicted from `where`'s cache, in order (for tests and traces; cleared by reset_stats).
  const std::vector<std::int32_t>& eviction_log(tier where) const;
  void reset_stats();
  std::string nvme_path() const;       // the NVMe store's file ("" without an NVMe tier)
  const io::page_io* nvme_io() const;  // the NVMe tier's page I/O (null without an NVMe tier)

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::memory
