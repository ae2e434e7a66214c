// Memory tiers and the per-tier ledger: every allocation the project makes is accounted here
// (bytes in use and peak per tier), so budgets and reports can be made per tier.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace troupe::memory {

enum class tier : std::uint8_t { host = 0, pinned = 1, device = 2, nvme = 3 };
inline constexpr int tier_count = 4;

constexpr std::string_view tier_name(tier t) {
  switch (t) {
    case tier::host:
      return "host";
    case tier::pinned:
      return "pinned";
    case tier::device:
      return "device";
    case tier::nvme:
      return "nvme";
  }
  return "?";
}

struct tier_stats {
  std::int64_t in_use = 0;       // bytes currently allocated
  std::int64_t peak = 0;         // high-water mark of in_use since start (or last reset)
  std::int64_t allocations = 0;  // number of allocations made
};

// Process-wide, thread-safe accounting.
void account_alloc(tier t, std::size_t bytes);
void account_free(tier t, std::size_t bytes);
tier_stats stats(tier t);
void reset_peak(tier t);  // peak := in_use

}  // namespace troupe::memory
