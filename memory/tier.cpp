#include "memory/tier.hpp"

#include <atomic>

namespace troupe::memory {
namespace {
struct counters {
  std::atomic<std::int64_t> in_use{0};
  std::atomic<std::int64_t> peak{0};
  std::atomic<std::int64_t> allocations{0};
};
counters g_ledger[tier_count];
}  // namespace

void account_alloc(tier t, std::size_t bytes) {
  auto& c = g_ledger[static_cast<int>(t)];
  auto now =
      c.in_use.fetch_add(static_cast<std::int64_t>(bytes)) + static_cast<std::int64_t>(bytes);
  c.allocations.fetch_add(1, std::memory_order_relaxed);
  auto p = c.peak.load();
  while (now > p && !c.peak.compare_exchange_weak(p, now)) {
  }
}

void account_free(tier t, std::size_t bytes) {
  g_ledger[static_cast<int>(t)].in_use.fetch_sub(static_cast<std::int64_t>(bytes));
}

tier_stats stats(tier t) {
  auto& c = g_ledger[static_cast<int>(t)];
  return {c.in_use.load(), c.peak.load(), c.allocations.load()};
}

void reset_peak(tier t) {
  auto& c = g_ledger[static_cast<int>(t)];
  c.peak.store(c.in_use.load());
}

}  // namespace troupe::memory
