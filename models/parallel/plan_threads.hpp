// plan_threads: a test helper that runs one thread per rank of a plan's dp x cp x pp x tp grid
// over local communicators (the plan tests: mixed_plans.test.cpp,
// models/post/plan_samples.test.cpp).
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

using rank_communicators = std::vector<std::vector<std::unique_ptr<collective::communicator>>>;

// fn(rank, groups_of(rank's communicators)) on one thread per rank of `comms`; a failing rank
// aborts every communicator, and the first failure (not the aborts it caused elsewhere) is
// rethrown.
inline void run_rank_threads(
    rank_communicators& comms,
    const std::function<parallel::hybrid_groups(
        std::vector<std::unique_ptr<collective::communicator>>&)>& groups_of,
    const std::function<void(int, const parallel::hybrid_groups&)>& fn) {
  const int n = static_cast<int>(comms.size());
  std::vector<std::exception_ptr> err(n);
  std::mutex mu;
  int first = -1;  // the rank that failed first
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r, groups_of(comms[r]));
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

// fn(rank, groups) on one thread per rank of the plan's dp x pp x tp grid (local groups); a
// failing rank aborts every communicator, and the first failure (not the aborts it caused
// elsewhere) is rethrown.
inline void run_plan(const scheduler::parallel_plan& plan,
                     const std::function<void(int, const parallel::hybrid_groups&)>& fn) {
  const int n = plan.world_size();
  auto world = std::make_shared<collective::local_world>(n);
  // Context parallelism: the grid's "cp" axis (scheduler::grid_order) and the cp and dp x cp
  // groups, as actors/training.cpp builds them.
  std::vector<collective::grid_axis> axes_of_grid;
  for (const auto& a : scheduler::grid_order(plan))
    if (a != "cp" || plan.cp > 1) axes_of_grid.push_back({a, scheduler::degree_of(plan, a)});
  collective::rank_grid grid(axes_of_grid);
  std::vector<std::vector<std::string>> groups{{"dp"}, {"pp"}, {"tp"}, {"pp", "tp"}};
  if (plan.cp > 1) {
    groups.push_back({"cp"});
    groups.push_back({"dp", "cp"});
  }
  rank_communicators comms(n);
  for (int r = 0; r < n; ++r)
    for (const auto& axes : groups)
      comms[r].push_back(
          collective::make_communicator(world->transport(r), grid.group(r, axes), "local", world));
  run_rank_threads(
      comms,
      [&](std::vector<std::unique_ptr<collective::communicator>>& c) {
        parallel::hybrid_groups g{c[0].get(), c[1].get(), c[2].get(), c[3].get()};
        if (plan.cp > 1) {
          g.cp = c[4].get();
          g.dp_cp = c[5].get();
        }
        return g;
      },
      fn);
}

}  // namespace troupe::models::testing
