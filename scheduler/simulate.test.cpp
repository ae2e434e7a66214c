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
action W(int mb) {
  return {k::weight, mb, 0, -1};
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
      {{{F(0), W(0), B(0)}}, "stage 0 action 1 (weight microbatch 0 chunk 0) runs before its back"},
      {{{F(0), B(0), W(0), W(0)}},
       "stage 0 action 3 (weight microbatch 0 chunk 0) runs a second time"},
      {{{F(0), B(0), W(1)}}, "stage 0 action 2 (weight microbatch 1 chunk 0) runs before its"},
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

TEST_CASE("a split backward costs backward minus weight and its weight action the rest") {
  // Stage 1 sends its input gradient after B = 3 - 1 and runs W = 1 after the send, so stage 0's
  // backward starts at 1 (F) + 1 (F) + 2 (B) = 4 and ends at 7; unsplit it would start at 5.
  const std::vector<std::vector<action>> split = {
      {F(0), send_act(0, 1), recv_grad(0, 1), B(0)},
      {recv_act(0, 0), F(0), B(0), send_grad(0, 0), W(0)}};
  const cost c{.forward = 1.0, .backward = 3.0, .p2p = 0.0, .weight = 1.0};
  for (auto mode : {p2p_mode::batched, p2p_mode::blocking, p2p_mode::async}) {
    auto sim = simulate(split, c, mode);
    REQUIRE(sim.ok());
    CHECK(sim.makespan == 7.0);
    CHECK(sim.busy == std::vector<double>{4.0, 4.0});
    CHECK(sim.start[1][4] == 4.0);  // the weight action, after the send
    CHECK(sim.finish[1][4] == 5.0);
    CHECK(sim.peak_in_flight == std::vector<int>{1, 1});
    CHECK(timeline(split, sim) ==
          "stage 0 |F0 .  .  .  B0 B0 B0 \n"
          "stage 1 |.  F0 B0 B0 W0 .  .  \n");
  }
  auto unsplit = split;
  unsplit[1].pop_back();
  auto sim = simulate(unsplit, c, p2p_mode::async);
  REQUIRE(sim.ok());
  CHECK(sim.makespan == 8.0);
}

TEST_CASE("a split microbatch is held until its weight action") {
  auto split = simulate({{F(0), B(0), F(1), B(1), W(0), W(1)}}, {1.0, 2.0, 0.0, 0.5});
  REQUIRE(split.ok());
  CHECK(split.peak_in_flight[0] == 2);
  CHECK(split.makespan == 6.0);
  auto unsplit = simulate({{F(0), B(0), F(1), B(1)}}, {1.0, 2.0, 0.0, 0.5});
  CHECK(unsplit.peak_in_flight[0] == 1);
}

TEST_CASE("a weight cost above the backward it splits is an error") {
  const cost c{.forward = 1.0, .backward = 1.0, .p2p = 0.0, .weight = 2.0};
  auto sim = simulate({{F(0), B(0), W(0)}}, c);
  CHECK_THAT(sim.error, Catch::Contains("stage 0 splits backwards") &&
                            Catch::Contains("cost.weight = 2 is not in [0, cost.backward = 1]"));
  // A list without weight actions runs full backwards and does not use cost.weight.
  CHECK(simulate({{F(0), B(0)}}, c).ok());
}
