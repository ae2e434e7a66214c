// one_rank_job: a coordinator and one node (rank 0 of a world of one) in this
// process, with the roles the caller registers: for tests of role actors (tier_actor,
// nvme_actor) and for single-process commands (troupe grpo). The node shuts down when the fixture
// goes; make job objects after it.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <string>

#include "actors/coordinator.hpp"
#include "actors/node.hpp"
#include "actors/roles.hpp"

namespace troupe::actors {

struct one_rank_job {
  coordinator coord;
  role_registry roles;
  std::unique_ptr<actors::node> n;

  explicit one_rank_job(const std::function<void(role_registry&)>& add_roles,
                        const std::string& name = "one-rank-test")
      : coord(options(name)) {
    add_roles(roles);
    node_options o;
    join_info j;
    j.coordinator = coord.endpoint();
    j.token = name + "-token";
    j.rank = 0;
    j.world_size = 1;
    j.local_rank = 0;
    j.net_device = "lo";
    j.source = "options";
    o.join = j;
    o.roles = &roles;
    o.join_timeout = std::chrono::milliseconds(30000);
    o.caf_threads = 1;
    n = std::make_unique<actors::node>(o);
  }
  ~one_rank_job() { n->shutdown(); }
  one_rank_job(const one_rank_job&) = delete;
  one_rank_job& operator=(const one_rank_job&) = delete;

  // The actor of that name in a fresh snapshot (null if absent); `keep` holds the snapshot.
  const actor_state* find(const std::string& name, job_snapshot& keep) {
    keep = coord.snapshot(std::chrono::milliseconds(5000));
    for (const auto& a : keep.actors)
      if (a.name == name) return &a;
    return nullptr;
  }

 private:
  static coordinator_options options(const std::string& name) {
    coordinator_options co;
    co.job = name;
    co.token = name + "-token";
    co.world_size = 1;
    co.register_job = false;
    co.heartbeat_timeout = std::chrono::milliseconds(10000);
    co.log = [](const std::string&) {};
    return co;
  }
};

}  // namespace troupe::actors
