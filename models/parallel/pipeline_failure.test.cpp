// A pipeline step that fails part way: ranks are threads of one local_world. A stage whose compute
// throws (an injected fetch failure, a throwing block hook) keeps to its transfers; every stage
// ends the step with an error (the failing one its own, the others one naming it), none hangs,
// and the next step on the same runners gives the single process's loss and gradients. A step
// whose transfers fail (a lost rank) leaves the runners refusing further steps with the cause.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/gpt.hpp"
#include "models/parallel/gpt_stage.hpp"
#include "models/parallel/pipeline_runner.hpp"
#include "models/parallel/testing.hpp"
#include "models/targets.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;

namespace {

constexpr int rows = 2, seq = 16, vocab = 64, m = 4;

gpt_config tiny() {
  return testing::gpt_shape(vocab, seq, 32, 4, 4);
}

struct data {
  std::vector<owned_tensor> ids, targets;
  data() {
    std::mt19937_64 g(3);
    for (int k = 0; k < m; ++k) {
      ids.push_back(empty({rows, seq}, dtype::i32));
      targets.push_back(empty({rows, seq}, dtype::i32));
      for (std::int64_t i = 0; i < rows * seq; ++i)
        ids[k].data_as<std::int32_t>()[i] = static_cast<std::int32_t>(g() % vocab);
      next_token_targets(ids[k], targets[k]);
    }
  }
  microbatch_data operator()(int k) const { return {ids[k], targets[k], 1.0 / m}; }
};

// Where a step fails: stage `stage` throws when it fetches microbatch `mb` (stage 0 and the last
// fetch), or from the block hook (any stage; the hook runs in the last microbatch's backward).
struct injection {
  int stage = 0, mb = 0;
  bool in_hook = false;
};

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
  return {};
}

// The runners of pp stages over one local world; step() runs one step on every rank's thread and
// returns each rank's error (empty: none) and loss.
struct pipeline {
  std::shared_ptr<collective::local_world> world;
  std::vector<std::unique_ptr<collective::communicator>> comms;
  std::vector<std::unique_ptr<gpt_stage>> stages;
  std::vector<std::unique_ptr<pipeline_runner>> runners;
  std::vector<std::string> error;
  std::vector<double> loss;
  bool hung = false;

  explicit pipeline(int pp, scheduler::schedule_kind kind = scheduler::schedule_kind::one_f_one_b)
      : world(std::make_shared<collective::local_world>(pp)) {
    comms = collective::make_local_group(world);
    scheduler::parallel_plan plan;
    plan.pp = pp;
    plan.schedule = kind;
    plan.microbatches = m;
    for (int s = 0; s < pp; ++s) {
      stages.push_back(
          std::make_unique<gpt_stage>(tiny(), batch_dims{rows, seq}, stage_options::of(plan, s)));
      stages[s]->init_weights(5);
      runners.push_back(std::make_unique<pipeline_runner>(*stages[s], *comms[s], plan));
    }
  }

  void step(const data& d, const std::function<void(int stage, int mb)>& on_fetch,
            const std::function<void(int stage)>& on_hook) {
    const int pp = static_cast<int>(stages.size());
    error.assign(pp, "");
    loss.assign(pp, 0.0);
    std::mutex ended_mu;
    std::condition_variable ended_cv;
    int ended = 0;
    std::vector<std::thread> threads;
    for (int s = 0; s < pp; ++s)
      threads.emplace_back([&, s] {
        try {
          stages[s]->memory().zero_grads();
          runners[s]->set_block_grads_hook([&, s](std::int64_t) { on_hook(s); });
          loss[s] = runners[s]->forward_backward(m, [&, s](int k) {
            on_fetch(s, k);
            return d(k);
          });
        } catch (...) {
          error[s] = what_of(std::current_exception());
        }
        std::lock_guard<std::mutex> lock(ended_mu);
        ++ended;
        ended_cv.notify_all();
      });
    // A stage left waiting for a message that never comes is a failure of the runner, not a
    // hang of the test: after 120 s (a hang guard, far above a step on a loaded machine) the
    // communicators are aborted so that the threads end.
    {
      std::unique_lock<std::mutex> lock(ended_mu);
      hung = !ended_cv.wait_for(lock, std::chrono::seconds(120), [&] { return ended == pp; });
    }
    if (hung)
      for (auto& c : comms) c->abort("the test's watchdog: the step did not end within 120 s");
    for (auto& t : threads) t.join();
  }

  void step(const data& d) {
    step(
        d, [](int, int) {}, [](int) {});
  }
};

// The single process's sum_k loss_k / m and its gradient.
double reference(gpt& model, const data& d) {
  model.memory().zero_grads();
  double loss = 0;
  for (int k = 0; k < m; ++k) {
    loss += model.forward(d.ids[k], d.targets[k]) / m;
    model.backward(1.0 / m);
  }
  return loss;
}

}  // namespace

TEST_CASE("A pipeline stage that fails mid step ends the step on every stage and the next is exact",
          "[parallel]") {
  const data d;
  gpt full(tiny(), {rows, seq});
  full.init_weights(5);
  auto exact = testing::f64_twin(full, {rows, seq});  // the exact step (tests/rounding.hpp)
  const double want = reference(full, d), exact_loss = reference(*exact, d);
  const int pp = GENERATE(2, 4);
  // Zero-bubble: stages > 0 split their backwards, so their weight actions are skipped after a
  // failure, and the hook of stage 1 (pp 4) runs in its last weight action.
  const auto kind =
      GENERATE(scheduler::schedule_kind::one_f_one_b, scheduler::schedule_kind::zero_bubble);
  std::vector<injection> cases{{0, 1, false}, {pp - 1, 2, false}, {pp - 1, 0, false}};
  if (pp == 4) cases.push_back({1, 0, true});
  pipeline pipe(pp, kind);
  for (const auto& inj : cases) {
    INFO(scheduler::name(kind) << " pp " << pp << ": stage " << inj.stage
                               << (inj.in_hook ? " hook" : " fetch of mb ")
                               << (inj.in_hook ? -1 : inj.mb));
    pipe.step(
        d,
        [&](int s, int k) {
          if (!inj.in_hook && s == inj.stage && k == inj.mb)
            throw std::runtime_error("injected fetch failure");
        },
        [&](int s) {
          if (inj.in_hook && s == inj.stage) throw std::runtime_error("injected hook failure");
        });
    CHECK_FALSE(pipe.hung);
    for (int s = 0; s < pp; ++s) {
      INFO("stage " << s << ": " << pipe.error[s]);
      if (s == inj.stage) {
        CHECK(pipe.error[s].find("injected") != std::string::npos);
      } else {
        CHECK(pipe.error[s].find("pipeline stage " + std::to_string(inj.stage) + " failed") !=
              std::string::npos);
      }
    }
    // The same runners again, nothing injected: the single process's loss and gradients, as
    // accurate as the single process's against its f64 twin (a microbatch left over from the
    // failed step would be off by O(|gradient|)).
    pipe.step(d);
    CHECK_FALSE(pipe.hung);
    gpt got(tiny(), {1, 1});
    got.memory().zero_grads();
    for (int s = 0; s < pp; ++s) {
      INFO("stage " << s << ": " << pipe.error[s]);
      CHECK(pipe.error[s].empty());
      auto v = tests::as_accurate_as(std::vector<double>{pipe.loss[s]}, std::vector<double>{want},
                                     std::vector<double>{exact_loss});
      INFO("loss: " << v.str());
      CHECK(v.ok());
      pipe.stages[s]->store_to(got.slots(), true, true);
    }
    const auto vg = testing::worst_by_name(got.slots(), full.slots(), exact->slots());
    INFO("worst gradient " << vg.name << ": " << vg.v.str());
    CHECK(vg.v.ok());
  }
}

TEST_CASE("A pipeline step whose transfers fail leaves the runner refusing later steps",
          "[parallel]") {
  const data d;
  pipeline pipe(2);
  // Rank 1 is lost while it fetches microbatch 1: both ends' transfers fail.
  pipe.step(
      d,
      [&](int s, int k) {
        if (s == 1 && k == 1) pipe.world->fail_peer(1, "rank 1 lost in the test");
      },
      [](int) {});
  CHECK_FALSE(pipe.hung);
  for (int s = 0; s < 2; ++s) {
    INFO("stage " << s << ": " << pipe.error[s]);
    CHECK(pipe.error[s].find("rank 1 lost in the test") != std::string::npos);
  }
  pipe.step(d);
  for (int s = 0; s < 2; ++s) {
    INFO("stage " << s << ": " << pipe.error[s]);
    CHECK(pipe.error[s].find("cannot run another step") != std::string::npos);
    CHECK(pipe.error[s].find("rank 1 lost in the test") != std::string::npos);
  }
}
