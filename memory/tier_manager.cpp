// The tier manager (see tier_manager.hpp): homes, two slot caches (device, host), a schedule
// cursor, Belady eviction and look-ahead prefetch.
#include "memory/tier_manager.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <limits>

#include "memory/buffer.hpp"
#include "memory/error.hpp"
#include "memory/io/nvme_store.hpp"

namespace troupe::memory {

std::string_view chunk_state_name(chunk_state s) {
  switch (s) {
    case chunk_state::resident:
      return "resident";
    case chunk_state::in_flight:
      return "in_flight";
    case chunk_state::evicted:
      return "evicted";
  }
  return "?";
}

namespace {

constexpr std::size_t page = 4096;
constexpr std::int64_t never = std::numeric_limits<std::int64_t>::max();

int cache_of(tier t) {
  TROUPE_CHECK(t == tier::device || t == tier::host, "tier_manager: chunks are used in the device ",
               "or host tier, not ", tier_name(t));
  return t == tier::device ? 0 : 1;
}

struct scoped_timer {
  double& into;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  ~scoped_timer() {
    into += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

}  // namespace

struct tier_manager::impl {
  struct chunk {
    std::size_t bytes = 0;
    tier home = tier::host;
    std::string label;
    buffer home_buf;         // device or host home
    bool home_valid = true;  // the home holds the current bytes
    bool on_disk = false;    // nvme home: a page has been written (else the bytes are zero)
    int slot[2] = {-1, -1};  // cache slot per tier (device, host)
    bool slot_valid[2] = {false, false};
    io::io_ticket pending[2];  // NVMe read into the slot under way
    int pins[2] = {0, 0};
  };
  struct cache {
    buffer pool;
    std::size_t slot_bytes = 0;
    std::vector<std::int32_t> owner;  // chunk per slot, -1 free
    std::vector<std::int32_t> evicted;
  };

  tier_manager_options opt;
  std::shared_ptr<io::page_io> nvme;  // before the chunks: their tickets go first
  std::vector<chunk> chunks;
  cache caches[2];
  bool planned = false;
  std::size_t reserved[2] = {0, 0};
  std::size_t home_bytes[2] = {0, 0};  // device homes, host homes
  std::vector<chunk_use> schedule;
  std::vector<std::vector<std::int64_t>> positions[2];  // [cache][chunk] -> schedule indices
  std::int64_t cursor = 0;
  tier_report stats;
  std::size_t device_peak = 0;

  std::size_t used(int k) const {
    return reserved[k] + home_bytes[k] + caches[k].owner.size() * caches[k].slot_bytes;
  }

  void plan() {
    if (planned) return;
    planned = true;
    std::size_t slot_bytes = 0;
    for (const auto& c : chunks) slot_bytes = std::max(slot_bytes, c.bytes);
    slot_bytes = (slot_bytes + page - 1) / page * page;
    const std::size_t budget[2] = {opt.device_bytes, opt.host_bytes};
    for (int k = 0; k < 2; ++k) {
      const tier t = k == 0 ? tier::device : tier::host;
      // Slots this tier could ever need: chunks living elsewhere (that the schedule, when there
      // is one, uses here).
      std::size_t want = 0;
      for (std::size_t i = 0; i < chunks.size(); ++i)
        if (chunks[i].home != t && (schedule.empty() || !positions[k][i].empty())) ++want;
      std::size_t base = reserved[k] + home_bytes[k];
      std::size_t n = want;
      if (budget[k] > 0 || k == 0) {
        TROUPE_CHECK(base <= budget[k], "tier_manager: the ", tier_name(t), " budget (", budget[k],
                     " bytes) is smaller than its home chunks and reserved bytes (", base, ")");
        n = slot_bytes == 0 ? 0 : std::min(want, (budget[k] - base) / slot_bytes);
      }
      TROUPE_CHECK(want == 0 || n > 0, "tier_manager: the ", tier_name(t), " budget (", budget[k],
                   " bytes) leaves no room for one ", slot_bytes, "-byte chunk slot after ", base,
                   " bytes of home chunks and reserved memory");
      caches[k].slot_bytes = slot_bytes;
      caches[k].owner.assign(n, -1);
      if (n > 0) caches[k].pool = buffer::host(n * slot_bytes, page);
    }
    device_peak = used(0);
  }

  std::byte* slot_ptr(int k, int s) const {
    return static_cast<std::byte*>(caches[k].pool.data()) + s * caches[k].slot_bytes;
  }

  std::byte* current_copy(std::int32_t id, int& k_out) {
    chunk& c = chunks[id];
    for (int k = 0; k < 2; ++k)
      if (c.slot[k] >= 0 && c.slot_valid[k]) {
        if (c.pending[k].valid()) finish_read(id, k);
        k_out = k;
        return slot_ptr(k, c.slot[k]);
      }
    k_out = -1;
    return nullptr;
  }

  // Gives up the chunk's slot in cache k (its bytes are not to be trusted).
  void abandon(std::int32_t id, int k) {
    chunk& c = chunks[id];
    if (c.slot[k] >= 0) caches[k].owner[c.slot[k]] = -1;
    c.slot[k] = -1;
    c.slot_valid[k] = false;
  }

  void finish_read(std::int32_t id, int k) {
    scoped_timer t{stats.io_seconds};
    io::io_ticket ticket = std::move(chunks[id].pending[k]);
    chunks[id].pending[k] = io::io_ticket();
    try {
      ticket.wait();  // throws on an I/O error or a checksum mismatch
    } catch (...) {
      abandon(id, k);  // else the next acquire would be a "hit" on bad bytes
      throw;
    }
  }

  std::int64_t next_use(std::int32_t id, int k) const {
    const auto& p = positions[k][id];
    if (p.empty()) return never;
    auto it = std::lower_bound(p.begin(), p.end(), cursor);
    if (it != p.end()) return *it;
    return static_cast<std::int64_t>(schedule.size()) + p.front();  // the next step
  }

  // Copies the home bytes into dst (NVMe: an asynchronous read when `async`).
  void read_home(std::int32_t id, std::byte* dst, int k, bool async) {
    chunk& c = chunks[id];
    if (c.home == tier::nvme) {
      if (!c.on_disk) {
        std::memset(dst, 0, c.bytes);
        return;
      }
      c.pending[k] = nvme->read(static_cast<std::uint64_t>(id), dst, c.bytes);
      stats.nvme_read_bytes += c.bytes;
      stats.bytes_moved += c.bytes;
      if (!async) finish_read(id, k);
      return;
    }
    scoped_timer t{stats.io_seconds};
    std::memcpy(dst, c.home_buf.data(), c.bytes);
    stats.bytes_moved += c.bytes;
  }

  void write_home(std::int32_t id, const std::byte* src) {
    chunk& c = chunks[id];
    scoped_timer t{stats.io_seconds};
    if (c.home == tier::nvme) {
      nvme->write(static_cast<std::uint64_t>(id), src, c.bytes).wait();
      c.on_disk = true;
      stats.nvme_write_bytes += c.bytes;
    } else {
      std::memcpy(c.home_buf.data(), src, c.bytes);
    }
    stats.bytes_moved += c.bytes;
    c.home_valid = true;
    ++stats.writebacks;
  }

  // Drops the chunk's copy in cache k, writing it home first when it is the only current one.
  void drop(std::int32_t id, int k, bool record) {
    chunk& c = chunks[id];
    const int s = c.slot[k];
    if (s < 0) return;
    if (c.pending[k].valid()) finish_read(id, k);
    const int o = 1 - k;
    if (c.slot_valid[k] && !c.home_valid && !(c.slot[o] >= 0 && c.slot_valid[o]))
      write_home(id, slot_ptr(k, s));
    c.slot[k] = -1;
    c.slot_valid[k] = false;
    caches[k].owner[s] = -1;
    if (record) {
      caches[k].evicted.push_back(id);
      ++stats.evictions;
    }
  }

  // A free slot of cache k, evicting the unpinned chunk used furthest ahead; -1 when every slot
  // is pinned, or (when `before` is given) when no victim is needed later than `before`.
  int take_slot(int k, std::int64_t before = never) {
    auto& ca = caches[k];
    int best = -1;
    std::int64_t best_next = -1;
    for (std::size_t s = 0; s < ca.owner.size(); ++s) {
      const std::int32_t o = ca.owner[s];
      if (o < 0) return static_cast<int>(s);
      if (chunks[o].pins[k] > 0) continue;
      std::int64_t n = next_use(o, k);
      if (n > best_next || (n == best_next && o > ca.owner[best])) {
        best_next = n;
        best = static_cast<int>(s);
      }
    }
    if (best < 0 || (before != never && best_next <= before)) return -1;
    drop(ca.owner[best], k, true);
    return best;
  }

  // Brings chunk id into cache k (slot s): from the other cache's current copy or from home.
  void fill(std::int32_t id, int k, int s, bool discard, bool async) {
    chunk& c = chunks[id];
    c.slot[k] = s;
    caches[k].owner[s] = id;
    c.slot_valid[k] = true;
    if (discard) return;
    try {
      std::byte* dst = slot_ptr(k, s);
      const int o = 1 - k;
      if (!c.home_valid) {
        TROUPE_CHECK(c.slot[o] >= 0 && c.slot_valid[o], "tier_manager: chunk ", id,
                     " has no current copy");
        if (c.pending[o].valid()) finish_read(id, o);
        scoped_timer t{stats.io_seconds};
        std::memcpy(dst, slot_ptr(o, c.slot[o]), c.bytes);
        stats.bytes_moved += c.bytes;
        return;
      }
      read_home(id, dst, k, async);
    } catch (...) {
      if (!c.pending[k].valid()) abandon(id, k);  // the slot holds no good bytes
      throw;
    }
  }

  // An acquire that is the schedule's next use moves the cursor on; any other leaves it.
  void advance(std::int32_t id, tier where) {
    const auto n = static_cast<std::int64_t>(schedule.size());
    if (n == 0 || !(schedule[cursor] == chunk_use{id, where})) return;
    cursor = cursor + 1 == n ? 0 : cursor + 1;
  }

  void prefetch() {
    if (opt.prefetch_depth <= 0 || schedule.empty()) return;
    std::vector<std::int32_t> seen;
    const auto n = static_cast<std::int64_t>(schedule.size());
    for (std::int64_t j = 0; j < std::min<std::int64_t>(opt.prefetch_depth, n); ++j) {
      const std::int64_t pos = cursor + j;
      const chunk_use u = schedule[pos % n];
      if (std::find(seen.begin(), seen.end(), u.chunk) != seen.end()) continue;
      seen.push_back(u.chunk);  // only a chunk's next use: a later one may see newer bytes
      chunk& c = chunks[u.chunk];
      const int k = cache_of(u.where);
      if (c.home == u.where || c.slot[k] >= 0) continue;
      if (c.pins[0] + c.pins[1] > 0) continue;  // in use now: its bytes may still change
      int s = take_slot(k, pos);
      if (s < 0) break;  // every slot holds a chunk needed sooner
      fill(u.chunk, k, s, false, true);
      ++stats.prefetches;
    }
  }
};

tier_manager::tier_manager(const tier_manager_options& opt) : impl_(std::make_unique<impl>()) {
  impl_->opt = opt;
  if (opt.nvme_io) {
    impl_->nvme = opt.nvme_io;
  } else if (!opt.nvme_dir.empty()) {
    io::nvme_store_options o;
    o.dir = opt.nvme_dir;
    o.capacity_bytes = opt.nvme_capacity_bytes;
    // A file of its own: two managers may share a directory.
    static std::atomic<std::uint64_t> stores{0};
    o.name = "troupe_tiers." + std::to_string(::getpid()) + "." + std::to_string(stores++);
    impl_->nvme = std::make_unique<io::nvme_store>(o);
  }
}

tier_manager::~tier_manager() {
  if (impl_ && impl_->nvme) impl_->nvme->wait_all();
}

tier_manager::tier_manager(tier_manager&&) noexcept = default;
tier_manager& tier_manager::operator=(tier_manager&&) noexcept = default;

std::int32_t tier_manager::add_chunk(std::size_t bytes, tier home, std::string_view label) {
  auto& m = *impl_;
  TROUPE_CHECK(!m.planned, "tier_manager: add_chunk after the first acquire");
  TROUPE_CHECK(bytes > 0, "tier_manager: chunk '", label, "' has no bytes");
  TROUPE_CHECK(home != tier::pinned, "tier_manager: chunk '", label, "': home must be device, ",
               "host or nvme");
  TROUPE_CHECK(home != tier::nvme || m.nvme, "tier_manager: chunk '", label,
               "' has its home on NVMe but no nvme_dir (nor nvme_io) was given");
  impl::chunk c;
  c.bytes = bytes;
  c.home = home;
  c.label = std::string(label);
  if (home != tier::nvme) {
    c.home_buf = buffer::host((bytes + page - 1) / page * page, page);
    std::memset(c.home_buf.data(), 0, c.home_buf.size());
    m.home_bytes[cache_of(home)] += c.home_buf.size();
  }
  m.chunks.push_back(std::move(c));
  m.positions[0].emplace_back();
  m.positions[1].emplace_back();
  return static_cast<std::int32_t>(m.chunks.size() - 1);
}

void tier_manager::reserve(tier where, std::size_t bytes) {
  TROUPE_CHECK(!impl_->planned, "tier_manager: reserve after the first acquire");
  impl_->reserved[cache_of(where)] += bytes;
}

void tier_manager::set_schedule(std::vector<chunk_use> uses) {
  auto& m = *impl_;
  for (int k = 0; k < 2; ++k)
    for (auto& p : m.positions[k]) p.clear();
  for (std::size_t i = 0; i < uses.size(); ++i) {
    TROUPE_CHECK(uses[i].chunk >= 0 && uses[i].chunk < chunks(), "tier_manager: schedule entry ", i,
                 " names chunk ", uses[i].chunk, " of ", chunks());
    m.positions[cache_of(uses[i].where)][uses[i].chunk].push_back(static_cast<std::int64_t>(i));
  }
  m.schedule = std::move(uses);
  m.cursor = 0;
}

std::byte* tier_manager::acquire(std::int32_t id, tier where, bool discard) {
  auto& m = *impl_;
  TROUPE_CHECK(id >= 0 && id < chunks(), "tier_manager: no chunk ", id);
  const int k = cache_of(where);
  m.plan();
  auto& c = m.chunks[id];
  std::byte* p = nullptr;
  if (c.home == where) {
    if (!c.home_valid && !discard) {  // bring the home up to date from the current copy
      int o = -1;
      std::byte* src = m.current_copy(id, o);
      TROUPE_CHECK(src != nullptr, "tier_manager: chunk ", id, " has no current copy");
      scoped_timer t{m.stats.io_seconds};
      std::memcpy(c.home_buf.data(), src, c.bytes);
      m.stats.bytes_moved += c.bytes;
    }
    c.home_valid = true;
    p = static_cast<std::byte*>(c.home_buf.data());
  } else {
    ++m.stats.acquires;
    if (c.slot[k] >= 0) {
      ++m.stats.hits;
      if (c.pending[k].valid()) m.finish_read(id, k);
    } else {
      int s = m.take_slot(k);
      TROUPE_CHECK(s >= 0, "tier_manager: the ", tier_name(where), " budget is too small: all ",
                   m.caches[k].owner.size(), " chunk slots are pinned (chunk ", id, " '", c.label,
                   "' needs one)");
      m.fill(id, k, s, discard, false);
    }
    p = m.slot_ptr(k, c.slot[k]);
  }
  ++c.pins[k];
  m.advance(id, where);
  try {
    m.prefetch();  // may fail (a write-back's ENOSPC or EIO, a failed read of a victim)
  } catch (...) {
    --c.pins[k];  // the acquire failed: nothing is left pinned
    throw;
  }
  m.device_peak = std::max(m.device_peak, m.used(0));
  return p;
}

void tier_manager::release(std::int32_t id, tier where, bool dirty) {
  auto& m = *impl_;
  TROUPE_CHECK(id >= 0 && id < chunks(), "tier_manager: no chunk ", id);
  const int k = cache_of(where);
  auto& c = m.chunks[id];
  TROUPE_CHECK(c.pins[k] > 0, "tier_manager: release of chunk ", id, " in ", tier_name(where),
               " without an acquire");
  --c.pins[k];
  if (!dirty) return;
  // This copy becomes the only current one.
  if (c.home != where) c.home_valid = false;
  const int o = 1 - k;
  if (c.slot[o] >= 0) {
    TROUPE_CHECK(c.pins[o] == 0, "tier_manager: chunk ", id, " was written in ", tier_name(where),
                 " while pinned in the other tier");
    c.slot_valid[o] = false;
    m.drop(id, o, false);
  }
  if (c.home == where) return;
  if (c.slot[k] >= 0) c.slot_valid[k] = true;
}

void tier_manager::flush() {
  auto& m = *impl_;
  for (int k = 0; k < 2; ++k)
    for (std::size_t s = 0; s < m.caches[k].owner.size(); ++s) {
      std::int32_t o = m.caches[k].owner[s];
      if (o < 0) continue;
      TROUPE_CHECK(m.chunks[o].pins[k] == 0, "tier_manager: flush while chunk ", o, " is pinned");
      m.drop(o, k, false);
    }
}

void tier_manager::rewind() {
  impl_->cursor = 0;
}

chunk_state tier_manager::state(std::int32_t id, tier where) const {
  const auto& c = impl_->chunks.at(static_cast<std::size_t>(id));
  if (where == tier::nvme)
    return c.home == tier::nvme && c.home_valid ? chunk_state::resident : chunk_state::evicted;
  const int k = cache_of(where);
  if (c.home == where) return c.home_valid ? chunk_state::resident : chunk_state::evicted;
  if (c.slot[k] < 0) return chunk_state::evicted;
  return c.pending[k].valid() ? chunk_state::in_flight : chunk_state::resident;
}

tier tier_manager::home(std::int32_t id) const {
  return impl_->chunks.at(static_cast<std::size_t>(id)).home;
}
std::size_t tier_manager::chunk_bytes(std::int32_t id) const {
  return impl_->chunks.at(static_cast<std::size_t>(id)).bytes;
}
std::int32_t tier_manager::chunks() const {
  return static_cast<std::int32_t>(impl_->chunks.size());
}
std::size_t tier_manager::slots(tier where) const {
  return impl_->caches[cache_of(where)].owner.size();
}

tier_report tier_manager::report() const {
  const auto& m = *impl_;
  tier_report r = m.stats;
  r.device_budget = m.opt.device_bytes;
  r.host_budget = m.opt.host_bytes;
  r.device_used = m.used(0);
  r.device_peak = m.device_peak;
  r.host_used = m.used(1);
  r.chunks = static_cast<std::int32_t>(m.chunks.size());
  for (std::size_t i = 0; i < m.chunks.size(); ++i) {
    const auto& c = m.chunks[i];
    const bool dev =
        (c.home == tier::device && c.home_valid) || (c.slot[0] >= 0 && c.slot_valid[0]);
    const bool host = (c.home == tier::host && c.home_valid) || (c.slot[1] >= 0 && c.slot_valid[1]);
    r.chunks_device += dev;
    r.chunks_host += host;
    r.chunks_nvme += c.home == tier::nvme && c.on_disk;
    for (int k = 0; k < 2; ++k) r.in_flight += c.pending[k].valid();
  }
  if (m.nvme) r.nvme_bytes = m.nvme->used_bytes();
  return r;
}

const std::vector<std::int32_t>& tier_manager::eviction_log(tier where) const {
  return impl_->caches[cache_of(where)].evicted;
}

void tier_manager::reset_stats() {
  auto& m = *impl_;
  m.stats = {};
  m.caches[0].evicted.clear();
  m.caches[1].evicted.clear();
  m.device_peak = m.used(0);
  if (m.nvme) m.nvme->reset_stats();
}

std::string tier_manager::nvme_path() const {
  return impl_->nvme ? impl_->nvme->path() : std::string();
}

const io::page_io* tier_manager::nvme_io() const {
  return impl_->nvme.get();
}

}  // namespace troupe::memory
