// paged_moments (see paged_moments.hpp): a ZeRO shard's moments in tier-manager chunks.
#include "models/parallel/paged_moments.hpp"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <vector>

#include "memory/error.hpp"

namespace troupe::models::parallel {
namespace {

using memory::tier;

}  // namespace

memory::tier_manager_options manager_options(const moment_tiers& o) {
  TROUPE_CHECK(o.home == tier::host || o.home == tier::nvme,
               "paged_moments: the moments' home must be host or nvme, got ",
               memory::tier_name(o.home));
  TROUPE_CHECK(o.home != tier::nvme || !o.nvme_dir.empty() || o.nvme_io != nullptr,
               "paged_moments: moments homed on nvme need an NVMe directory");
  memory::tier_manager_options m;
  m.host_bytes = o.host_bytes;
  m.nvme_dir = o.home == tier::nvme ? o.nvme_dir : std::string();
  m.nvme_capacity_bytes = o.nvme_capacity_bytes;
  m.nvme_io = o.nvme_io;
  m.prefetch_depth = o.prefetch_depth;
  return m;
}

void make_nvme_dir(const moment_tiers& o) {
  if (o.home != tier::nvme || o.nvme_io != nullptr) return;
  std::error_code ec;
  std::filesystem::create_directories(o.nvme_dir, ec);
  TROUPE_CHECK(!ec, "paged_moments: cannot create the NVMe directory '", o.nvme_dir,
               "': ", ec.message());
}

namespace {

tensor f32_view(std::byte* p, std::int64_t n) {
  return tensor(p, static_cast<std::size_t>(n) * 4, dtype::f32, {n}, device::cpu());
}

}  // namespace

moment_tiers moment_tiers_of(const train_config& cfg, int dp_rank) {
  moment_tiers t;
  const std::string& name = cfg.mem_optimizer_tier;
  t.home = name.empty() ? (cfg.mem_nvme_dir.empty() ? tier::host : tier::nvme)
                        : (name == "nvme" ? tier::nvme : tier::host);
  t.host_bytes = cfg.mem_host;
  if (!cfg.mem_nvme_dir.empty())
    t.nvme_dir =
        (std::filesystem::path(cfg.mem_nvme_dir) / ("dp" + std::to_string(dp_rank))).string();
  t.nvme_capacity_bytes = cfg.mem_nvme_capacity;
  return t;
}

paged_moments::paged_moments(std::int64_t elements, const moment_tiers& opt)
    : elements_(std::max<std::int64_t>(elements, 1)),
      segment_(std::max<std::int64_t>(static_cast<std::int64_t>(opt.segment_bytes / 4), 16)),
      segments_(static_cast<std::int32_t>((elements_ + segment_ - 1) / segment_)),
      tiers_(manager_options(opt)) {
  make_nvme_dir(opt);
  const std::size_t bytes = static_cast<std::size_t>(segment_) * 4;
  std::vector<memory::chunk_use> schedule;
  for (std::int32_t s = 0; s < segments_; ++s) {
    tiers_.add_chunk(bytes, opt.home, "m." + std::to_string(s));
    tiers_.add_chunk(bytes, opt.home, "v." + std::to_string(s));
    schedule.push_back({2 * s, tier::host});
    schedule.push_back({2 * s + 1, tier::host});
  }
  tiers_.set_schedule(std::move(schedule));
}

void paged_moments::for_each(
    const std::function<void(std::int64_t first, const tensor& m, const tensor& v)>& f,
    bool write) {
  for (std::int32_t s = 0; s < segments_; ++s) {
    const std::int64_t first = s * segment_, n = std::min(segment_, elements_ - first);
    std::byte* m = tiers_.acquire(2 * s, tier::host);
    std::byte* v = nullptr;
    try {
      v = tiers_.acquire(2 * s + 1, tier::host);
      f(first, f32_view(m, n), f32_view(v, n));
    } catch (...) {
      if (v != nullptr) tiers_.release(2 * s + 1, tier::host, false);
      tiers_.release(2 * s, tier::host, false);
      throw;
    }
    tiers_.release(2 * s + 1, tier::host, write);
    tiers_.release(2 * s, tier::host, write);
  }
}

void paged_moments::copy_out(const tensor& m, const tensor& v) {
  for_each(
      [&](std::int64_t first, const tensor& sm, const tensor& sv) {
        std::memcpy(m.data_as<float>() + first, sm.data(), sm.numel() * 4);
        std::memcpy(v.data_as<float>() + first, sv.data(), sv.numel() * 4);
      },
      false);
  tiers_.rewind();
}

void paged_moments::copy_in(const tensor& m, const tensor& v) {
  for_each(
      [&](std::int64_t first, const tensor& sm, const tensor& sv) {
        std::memcpy(sm.data(), m.data_as<float>() + first, sm.numel() * 4);
        std::memcpy(sv.data(), v.data_as<float>() + first, sv.numel() * 4);
      },
      true);
  tiers_.rewind();
}

}  // namespace troupe::models::parallel
