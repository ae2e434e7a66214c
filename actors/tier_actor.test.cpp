// The tier-manager role actor on a one-rank job: it builds a session over a real tier manager,
// steps it, and its numbers reach the coordinator's snapshot as metrics.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstring>
#include <memory>
#include <string>

#include "actors/coordinator.hpp"
#include "actors/node.hpp"
#include "actors/roles.hpp"
#include "actors/tier_actor.hpp"

using namespace troupe;
using namespace troupe::actors;
using namespace std::chrono_literals;

namespace {

// A session that pages `chunks` host-home chunks through a device tier of three slots, one pass
// over a cyclic schedule per step; its "loss" is the pass's misses.
class paging_session : public tier_session {
 public:
  explicit paging_session(const tier_setup& s) : tm_(options(s)) {
    for (int i = 0; i < chunks_; ++i) tm_.add_chunk(64 * 1024, memory::tier::host);
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
  static memory::tier_manager_options options(const tier_setup& s) {
    memory::tier_manager_options o;
    o.device_bytes = s.device_bytes;
    o.prefetch_depth = 1;
    return o;
  }
  int chunks_ = 6;
  memory::tier_manager tm_;
};

const actor_state* find_actor(const job_snapshot& s, const std::string& name) {
  for (const auto& a : s.actors)
    if (a.name == name) return &a;
  return nullptr;
}

}  // namespace

TEST_CASE("The tier manager actor publishes its tier numbers as metrics", "[offload]") {
  coordinator_options co;
  co.job = "tier-actor-test";
  co.token = "tier-token";
  co.world_size = 1;
  co.register_job = false;
  co.heartbeat_timeout = 10000ms;
  co.log = [](const std::string&) {};
  coordinator coord(co);

  role_registry roles;
  add_tier_manager_role(roles, [](const tier_setup& s) -> std::unique_ptr<tier_session> {
    return std::make_unique<paging_session>(s);
  });
  node_options o;
  join_info j;
  j.coordinator = coord.endpoint();
  j.token = co.token;
  j.rank = 0;
  j.world_size = 1;
  j.local_rank = 0;
  j.net_device = "lo";
  j.source = "options";
  o.join = j;
  o.roles = &roles;
  o.join_timeout = 30000ms;
  o.caf_threads = 1;
  node n(o);
  {
    job jb(n);
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
    auto snap = coord.snapshot(5000ms);
    const actor_state* a = find_actor(snap, tm.name);
    REQUIRE(a != nullptr);
    CHECK(a->role == tier_manager_role);
    CHECK(a->metrics.at("step") == 3);
    for (const char* k : {"tier.evictions", "tier.prefetch_hit_rate", "tier.device_bytes",
                          "tier.chunks_host", "tier.io_gbps"})
      CHECK(a->metrics.at(k) == numbers.at(k));
    jb.stop(tm);
  }
  n.shutdown();
}
