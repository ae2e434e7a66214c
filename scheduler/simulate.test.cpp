// The simulator finds what is wrong with hand-broken schedules: deadlocks, missing inputs, wrong
// peers, leaked activations.
#include <catch2/catch.hpp>

#include "scheduler/pipeline.hpp"
#include "scheduler/simulate.hpp"

using namespace troupe::scheduler;

namespace {
using k = action_kind;
action F(int mb) {
  return {k::forward, mb, 0, -1};
}
action B(int mb) {
  return {k::backward, mb, 0, -1};
}
action send_act(int mb, int to) {
  return {k::send_activation, mb, 0, to};
}
action recv_act(int mb, int from) {
  return {k::recv_activation, mb, 0, from};
}
action send_grad(int mb, int to) {
  return {k::send_grad, mb, 0, to};
}
action recv_grad(int mb, int from) {
  return {k::recv_grad, mb, 0, from};
}
}  // namespace

TEST_CASE("naive 1f1b transfer order deadlocks with blocking sends and the error names it") {
  // Stage 1 sends the gradient of microbatch 0 before receiving microbatch 1, while stage 0 sends
  // microbatch 1 before receiving that gradient: each send waits for a receive the other stage
  // has not reached.
  std::vector<std::vector<action>> lists = {
      {F(0), send_act(0, 1), F(1), send_act(1, 1), recv_grad(0, 1), B(0), recv_grad(1, 1), B(1)},
      {recv_act(0, 0), F(0), B(0), send_grad(0, 0), recv_act(1, 0), F(1), B(1), send_grad(1, 0)}};
  auto sim = simulate(lists, {}, p2p_mode::blocking);
  REQUIRE(!sim.ok());
  CHECK(sim.error ==
        "deadlock: stage 0 action 3 (send_activation microbatch 1 chunk 0 to stage 1) can never "
        "proceed: stage 1 waits at its action 3 (send_grad microbatch 0 chunk 0 to stage 0)");
  // Batching the two transfers of each side (as Megatron's send_backward_recv_forward does) lets
  // the same lists run.
  lists[0] = {F(0), send_act(0, 1),  F(1), send_act(1, 1), recv_grad(0, 1),
              B(0), recv_grad(1, 1), B(1)};
  CHECK(simulate(lists, {}, p2p_mode::batched).ok());
}

TEST_CASE("a receive nobody sends is reported as a deadlock at that receive") {
  auto lists = make_schedules(schedule_kind::gpipe, 3, 2);
  // Drop stage 1's second activation send.
  auto& l1 = lists[1];
  for (auto it = l1.begin(); it != l1.end(); ++it)
    if (it->kind == k::send_activation && it->microbatch == 1) {
      l1.erase(it);
      break;
    }
  auto sim = simulate(lists, {});
  REQUIRE(!sim.ok());
  CHECK_THAT(
      sim.error,
      Catch::Equals("deadlock: stage 1 action 5 (recv_grad microbatch 0 chunk 0 from stage 2) "
                    "can never proceed: stage 2 waits at its action 2 (recv_activation "
                    "microbatch 1 chunk 0 from stage 1)"));
}

TEST_CASE("broken dependencies inside one list are reported before running") {
  struct bad {
    std::vector<std::vector<action>> lists;
    std::string says;
  };
  const std::vector<bad> cases = {
      {{{F(0), send_act(0, 1), recv_grad(0, 1), B(0)}, {F(0), B(0), send_grad(0, 0)}},
       "stage 1 action 0 (forward microbatch 0 chunk 0) runs before a recv_activation brought its "
       "input"},
      {{{F(0), B(0)}, {}},
       "stage 0 action 1 (backward microbatch 0 chunk 0) runs before a "
       "recv_grad brought its output's gradient"},
      {{{F(0), send_act(0, 1), recv_grad(0, 1), B(0)},
        {recv_act(0, 0), F(0), send_grad(0, 0), B(0)}},
       "stage 1 action 2 (send_grad microbatch 0 chunk 0 to stage 0) comes before the backward"},
      {{{F(0), send_act(0, 0)}, {}}, "names stage 0, but virtual stage 1 lives on stage 1"},
      {{{F(0)}}, "stage 0: forward microbatch 0 chunk 0 has no backward"},
      {{{F(0), B(0), F(0), B(0)}}, "stage 0 action 2 (forward microbatch 0 chunk 0) runs a second"},
      {{{F(0), B(0), send_grad(0, 0)}}, "has no peer: virtual stage 0 is the first"},
      {{{B(0)}}, "runs before its forward"},
  };
  for (const auto& c : cases) {
    auto sim = simulate(c.lists, {});
    INFO(c.says);
    CHECK_THAT(sim.error, Catch::Contains(c.says));
  }
}

TEST_CASE("a single stage runs its list back to back") {
  auto sim = simulate(make_schedules(schedule_kind::one_f_one_b, 1, 5), {1.0, 2.0, 9.0});
  REQUIRE(sim.ok());
  CHECK(sim.makespan == 15.0);
  CHECK(sim.bubble_fraction == 0.0);
  CHECK(sim.peak_in_flight[0] == 1);
}
