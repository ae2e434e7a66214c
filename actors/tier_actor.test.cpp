// The tier-manager role actor on a one-rank job: it builds a session over a real tier manager,
// steps it, and its numbers reach the coordinator's snapshot as metrics.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>

#include "actors/coordinator.hpp"
#include "actors/node.hpp"
#include "actors/nvme_actor.hpp"
#include "actors/one_rank_job.hpp"
#include "actors/roles.hpp"
#include "actors/tier_actor.hpp"

using namespace troupe;
using namespace troupe::actors;
using namespace std::chrono_literals;

namespace {

// A session that pages `chunks` host-home chunks (NVMe-home when the actor gives it an NVMe
// tier) through a device tier of three slots, one pass over a cyclic schedule per step; its
// "loss" is the pass's misses.
class paging_session : public tier_session {
 public:
  paging_session(const tier_setup& s, const tier_resources& r) : tm_(options(s, r)) {
    const auto home = r.nvme ? memory::tier::nvme : memory::tier::host;
    for (int i = 0; i < chunks_; ++i) tm_.add_chunk(64 * 1024, home);
    std::vector<memory::chunk_use> uses;
    for (int i = 0; i < chunks_; ++i) uses.push_back({i, memory::tier::device});
    tm_.set_schedule(uses);
  }
  std::string describe() override { return "paging " + std::to_string(chunks_) + " chunks"; }
  double step() override {
    auto before = tm_.report();
    for (int i = 0; i < chunks_; ++i) {
      std::byte* p = tm_.acquire(i, memory::tier::device);
      p[0] = std::byte{1};
      tm_.release(i, memory::tier::device, true);
    }
    auto after = tm_.report();
    return static_cast<double>((after.acquires - after.hits) - (before.acquires - before.hits));
  }
  memory::tier_report report() override { return tm_.report(); }

 private:
  static memory::tier_manager_options options(const tier_setup& s, const tier_resources& r) {
    memory::tier_manager_options o;
    o.device_bytes = s.device_bytes;
    o.nvme_io = r.nvme;
    o.prefetch_depth = 1;
    return o;
  }
  int chunks_ = 6;
  memory::tier_manager tm_;
};

void add_paging_role(role_registry& roles) {
  add_tier_manager_role(roles, [](const tier_setup& s, const tier_resources& r) {
    return std::make_unique<paging_session>(s, r);
  });
}

}  // namespace

TEST_CASE("The tier manager actor pages its NVMe tier through an nvme actor", "[offload][nvme]") {
  const auto dir =
      std::filesystem::path("/var/tmp") / ("troupe_tier_actor_test_" + std::to_string(::getpid()));
  {
    one_rank_job w(add_paging_role, "tier-actor-test");
    job jb(*w.n);
    auto tm = jb.spawn(tier_manager_role, 0);
    tier_setup s;
    s.device_bytes = 3 * 64 * 1024;
    s.nvme_dir = dir.string();
    CHECK(jb.ask<std::string>(tm, s, 10s) == "paging 6 chunks");
    auto r = jb.ask<tier_step_reply>(tm, tier_step{2}, 10s);
    REQUIRE(r.losses.size() == 2);
    auto numbers = jb.ask<std::map<std::string, double>>(tm, tier_numbers_request{}, 10s);
    CHECK(numbers.at("tier.chunks_nvme") > 0);
    CHECK(numbers.at("tier.nvme_write_gb") > 0);
    // Prefetch reads issued at the end of the step may still be on their way: the NVMe actor's
    // numbers reach the tier manager's later. Polled (a snapshot has no change event) until they
    // do; the deadline only guards against a hang, the pace only spares the CPU.
    const double written = numbers.at("tier.nvme_write_gb") * 1e9;
    const double read = numbers.at("tier.nvme_read_gb") * 1e9;
    job_snapshot snap;
    const actor_state* nv = nullptr;
    for (const auto give_up = std::chrono::steady_clock::now() + 60s;;) {
      nv = w.find(tm.name + ".nvme", snap);
      if (nv && nv->metrics.count("nvme.bytes_read") &&
          nv->metrics.at("nvme.bytes_read") == Approx(read))
        break;
      if (std::chrono::steady_clock::now() > give_up) break;
      std::this_thread::sleep_for(50ms);
    }
    REQUIRE(nv != nullptr);
    CHECK(nv->role == nvme_role);
    CHECK(nv->metrics.at("nvme.bytes_written") == Approx(written));
    CHECK(nv->metrics.at("nvme.bytes_read") == Approx(read));
    CHECK(nv->activity.find(dir.string()) != std::string::npos);
    jb.stop(tm);
  }
  CHECK(std::filesystem::is_empty(dir));  // the store's file went with the nvme actor
  std::filesystem::remove_all(dir);
}

TEST_CASE("The tier manager actor publishes its tier numbers as metrics", "[offload]") {
  one_rank_job w(add_paging_role, "tier-actor-test");
  {
    job jb(*w.n);
    auto tm = jb.spawn(tier_manager_role, 0);
    tier_setup s;
    s.device_bytes = 3 * 64 * 1024;
    CHECK(jb.ask<std::string>(tm, s, 10s) == "paging 6 chunks");
    auto r = jb.ask<tier_step_reply>(tm, tier_step{3}, 10s);
    REQUIRE(r.losses.size() == 3);
    CHECK(r.losses[0] > 0);  // six chunks through three slots: misses every pass
    auto numbers = jb.ask<std::map<std::string, double>>(tm, tier_numbers_request{}, 10s);
    CHECK(numbers.at("tier.chunks") == 6);
    CHECK(numbers.at("tier.device_budget") == 3 * 64 * 1024);
    CHECK(numbers.at("tier.evictions") > 0);
    job_snapshot snap;
    const actor_state* a = w.find(tm.name, snap);
    REQUIRE(a != nullptr);
    CHECK(a->role == tier_manager_role);
    CHECK(a->metrics.at("step") == 3);
    for (const char* k : {"tier.evictions", "tier.prefetch_hit_rate", "tier.device_bytes",
                          "tier.chunks_host", "tier.io_gbps"})
      CHECK(a->metrics.at(k) == numbers.at(k));
    jb.stop(tm);
  }
}
