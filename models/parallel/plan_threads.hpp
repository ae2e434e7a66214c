// plan_threads: a test helper that runs one thread per rank of a plan's dp x pp x tp grid over
// local communicators (the plan tests: mixed_plans.test.cpp, models/post/plan_samples.test.cpp).
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "models/parallel/hybrid.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models::testing {

// fn(rank, groups) on one thread per rank of the plan's dp x pp x tp grid (local groups); a
// failing rank aborts every communicator, and the first failure (not the aborts it caused
// elsewhere) is rethrown.
inline void run_plan(const scheduler::parallel_plan& plan,
                     const std::function<void(int, const parallel::hybrid_groups&)>& fn) {
  const int n = plan.world_size();
  auto world = std::make_shared<collective::local_world>(n);
  collective::rank_grid grid({{"dp", plan.dp}, {"pp", plan.pp}, {"tp", plan.tp}});
  std::vector<std::vector<std::unique_ptr<collective::communicator>>> comms(n);
  for (int r = 0; r < n; ++r)
    for (const auto& axes :
         std::vector<std::vector<std::string>>{{"dp"}, {"pp"}, {"tp"}, {"pp", "tp"}})
      comms[r].push_back(
          collective::make_communicator(world->transport(r), grid.group(r, axes), "local", world));
  std::vector<std::exception_ptr> err(n);
  std::mutex mu;
  int first = -1;  // the rank that failed first
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        auto& c = comms[r];
        fn(r, parallel::hybrid_groups{c[0].get(), c[1].get(), c[2].get(), c[3].get()});
      } catch (...) {
        err[r] = std::current_exception();
        std::lock_guard lk(mu);
        if (first < 0) first = r;
        for (auto& rc : comms)
          for (auto& c : rc) c->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  if (first >= 0) std::rethrow_exception(err[first]);
}

}  // namespace troupe::models::testing
