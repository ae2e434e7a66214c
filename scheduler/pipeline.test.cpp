// Pipeline schedules: structure checked from the lists alone, then timing checked by the simulator
// against the closed forms of Huang et al. (GPipe) and Narayanan et al. 2021 (1F1B, interleaved).
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>

#include "scheduler/pipeline.hpp"
#include "scheduler/simulate.hpp"

using namespace troupe::scheduler;

namespace {

struct combo {
  schedule_kind kind;
  int p, m, v;
};

// Every schedulable (kind, stages, microbatches, chunks) with stages 1..8 and microbatches 1..16.
std::vector<combo> all_combos() {
  std::vector<combo> out;
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      out.push_back({schedule_kind::gpipe, p, m, 1});
      out.push_back({schedule_kind::one_f_one_b, p, m, 1});
      out.push_back({schedule_kind::eager_1f1b, p, m, 1});
      out.push_back({schedule_kind::zero_bubble, p, m, 1});
      if (p >= 2 && m % p == 0)
        for (int v = 2; v <= 4; ++v) out.push_back({schedule_kind::interleaved, p, m, v});
    }
  return out;
}

std::string name_of(const combo& c) {
  return std::string(name(c.kind)) + " p=" + std::to_string(c.p) + " m=" + std::to_string(c.m) +
         " v=" + std::to_string(c.v);
}

// Eager 1F1B and zero-bubble share their transfers: one spare microbatch per link.
bool eager_links(schedule_kind k) {
  return k == schedule_kind::eager_1f1b || k == schedule_kind::zero_bubble;
}

// The compute actions of a list as "F0 B0 W0 ..." (transfers left out).
std::string computes(const std::vector<action>& list) {
  std::string out;
  for (const auto& a : list) {
    if (!is_compute(a.kind)) continue;
    out += out.empty() ? "" : " ";
    out += a.kind == action_kind::forward ? 'F' : a.kind == action_kind::backward ? 'B' : 'W';
    out += std::to_string(a.microbatch);
  }
  return out;
}

// The most microbatches a stage holds, counted from its list alone: a forward takes one, a
// backward frees it unless the list has a weight action for it, which frees it then.
int held_from_list(const std::vector<action>& list) {
  std::set<std::pair<int, int>> split;
  for (const auto& a : list)
    if (a.kind == action_kind::weight) split.insert({a.microbatch, a.chunk});
  int held = 0, peak = 0;
  for (const auto& a : list) {
    if (a.kind == action_kind::forward) peak = std::max(peak, ++held);
    if (a.kind == action_kind::weight ||
        (a.kind == action_kind::backward && !split.count({a.microbatch, a.chunk})))
      --held;
  }
  return peak;
}

// Where virtual stage `vs` lives, written out independently of the simulator.
int stage_of(int vs, int p) {
  return vs % p;
}
int chunk_of(int vs, int p) {
  return vs / p;
}

}  // namespace

TEST_CASE("every schedule computes each microbatch once per stage and chunk in a valid order") {
  for (const auto& c : all_combos()) {
    INFO(name_of(c));
    auto all = make_schedules(c.kind, c.p, c.m, c.v);
    REQUIRE(static_cast<int>(all.size()) == c.p);
    // Transfers as (sender stage, kind sent, microbatch, sender's chunk) -> receiver's action.
    std::multiset<std::tuple<int, int, int, int, int, int>> sends, recvs;
    for (int s = 0; s < c.p; ++s) {
      INFO("stage " << s);
      REQUIRE(all[s] == make_schedule(c.kind, s, c.p, c.m, c.v));
      std::map<std::pair<int, int>, int> fwd_at, bwd_at, wgt_at, input_at, grad_at;
      for (int i = 0; i < static_cast<int>(all[s].size()); ++i) {
        const action& a = all[s][i];
        std::pair<int, int> id{a.microbatch, a.chunk};
        REQUIRE(a.microbatch >= 0);
        REQUIRE(a.microbatch < c.m);
        REQUIRE(a.chunk >= 0);
        REQUIRE(a.chunk < c.v);
        const int vs = a.chunk * c.p + s;
        switch (a.kind) {
          case action_kind::forward:
            REQUIRE(fwd_at.emplace(id, i).second);
            if (vs != 0) REQUIRE(input_at.count(id));
            break;
          case action_kind::backward:
            REQUIRE(bwd_at.emplace(id, i).second);
            REQUIRE(fwd_at.count(id));
            if (vs != c.p * c.v - 1) REQUIRE(grad_at.count(id));
            break;
          case action_kind::weight:  // at most once, after its backward
            REQUIRE(wgt_at.emplace(id, i).second);
            REQUIRE(bwd_at.count(id));
            REQUIRE(a.peer == -1);
            break;
          case action_kind::recv_activation:
            REQUIRE(input_at.emplace(id, i).second);
            REQUIRE(vs > 0);
            REQUIRE(a.peer == stage_of(vs - 1, c.p));
            recvs.insert({a.peer, 0, a.microbatch, chunk_of(vs - 1, c.p), s, a.chunk});
            break;
          case action_kind::recv_grad:
            REQUIRE(grad_at.emplace(id, i).second);
            REQUIRE(vs < c.p * c.v - 1);
            REQUIRE(a.peer == stage_of(vs + 1, c.p));
            recvs.insert({a.peer, 1, a.microbatch, chunk_of(vs + 1, c.p), s, a.chunk});
            break;
          case action_kind::send_activation:
            REQUIRE(fwd_at.count(id));
            REQUIRE(vs < c.p * c.v - 1);
            REQUIRE(a.peer == stage_of(vs + 1, c.p));
            sends.insert({s, 0, a.microbatch, a.chunk, a.peer, chunk_of(vs + 1, c.p)});
            break;
          case action_kind::send_grad:
            REQUIRE(bwd_at.count(id));
            REQUIRE(vs > 0);
            REQUIRE(a.peer == stage_of(vs - 1, c.p));
            sends.insert({s, 1, a.microbatch, a.chunk, a.peer, chunk_of(vs - 1, c.p)});
            break;
        }
      }
      // Exactly one forward and one backward of every (microbatch, chunk).
      CHECK(static_cast<int>(fwd_at.size()) == c.m * c.v);
      CHECK(static_cast<int>(bwd_at.size()) == c.m * c.v);
      // Weight passes: zero-bubble only, one per microbatch on every stage but the first.
      const bool split = c.kind == schedule_kind::zero_bubble && s > 0;
      CHECK(static_cast<int>(wgt_at.size()) == (split ? c.m * c.v : 0));
    }
    // Every send has exactly one receive on its peer and the other way round.
    CHECK(sends == recvs);
    CHECK(static_cast<int>(sends.size()) == 2 * c.m * (c.p * c.v - 1));
  }
}

TEST_CASE("gpipe and 1f1b links carry mirrored send and receive sequences") {
  // The k-th transfer stage s posts towards s + 1 meets the k-th transfer s + 1 posts towards s:
  // then no wait-for cycle can form even when every transfer blocks on its own. (Eager 1F1B and
  // zero-bubble send activations ahead of the gradients they receive on purpose, so their links
  // are not mirrored.)
  for (const auto& c : all_combos()) {
    if (c.kind == schedule_kind::interleaved || eager_links(c.kind)) continue;
    INFO(name_of(c));
    auto all = make_schedules(c.kind, c.p, c.m, c.v);
    for (int s = 0; s + 1 < c.p; ++s) {
      std::vector<action> left, right;
      for (const auto& a : all[s])
        if (!is_compute(a.kind) && a.peer == s + 1) left.push_back(a);
      for (const auto& a : all[s + 1])
        if (!is_compute(a.kind) && a.peer == s) right.push_back(a);
      REQUIRE(left.size() == right.size());
      for (std::size_t k = 0; k < left.size(); ++k) {
        INFO("link " << s << " transfer " << k);
        const auto want = left[k].kind == action_kind::send_activation
                              ? action_kind::recv_activation
                          : left[k].kind == action_kind::recv_grad ? action_kind::send_grad
                                                                   : action_kind::forward;
        REQUIRE(want != action_kind::forward);
        CHECK(right[k].kind == want);
        CHECK(right[k].microbatch == left[k].microbatch);
      }
    }
  }
}

TEST_CASE("no schedule deadlocks with batched or with blocking transfers") {
  // Blocking is the stricter model (a send waits for its receive even inside a batch). GPipe and
  // 1F1B cannot deadlock under it (mirrored links, above); the interleaved lists have a ring link
  // from the last stage back to the first, so for them this is checked, not proven. Eager 1F1B
  // needs its batches posted together, or sends that do not wait (async, the runner's default):
  // under blocking transfers stage 0's first steady-state send (an activation its successor
  // receives only after sending a gradient) and the successor's gradient send (which stage 0
  // receives only after that activation) wait for each other (checked below). Zero-bubble has
  // eager 1F1B's transfers; it runs with its backwards split (cost.weight > 0) too.
  for (const auto& c : all_combos()) {
    INFO(name_of(c));
    auto all = make_schedules(c.kind, c.p, c.m, c.v);
    CHECK(simulate(all, {}, p2p_mode::batched).error == "");
    if (!eager_links(c.kind)) CHECK(simulate(all, {}, p2p_mode::blocking).error == "");
    CHECK(simulate(all, {}, p2p_mode::async).error == "");
    if (c.kind == schedule_kind::zero_bubble) {
      const cost split{.forward = 1.0, .backward = 2.0, .p2p = 0.25, .weight = 1.0};
      CHECK(simulate(all, split, p2p_mode::batched).error == "");
      CHECK(simulate(all, split, p2p_mode::async).error == "");
    }
  }
}

TEST_CASE("1f1b holds at most stages minus stage microbatches while gpipe holds all of them") {
  for (const auto& c : all_combos()) {
    if (c.kind == schedule_kind::interleaved) continue;
    INFO(name_of(c));
    auto sim = simulate(make_schedules(c.kind, c.p, c.m), {});
    REQUIRE(sim.ok());
    for (int s = 0; s < c.p; ++s) {
      INFO("stage " << s);
      if (c.kind == schedule_kind::gpipe) {
        CHECK(sim.peak_in_flight[s] == c.m);
      } else if (c.kind == schedule_kind::eager_1f1b) {  // 2 (p - s - 1) + 1
        CHECK(sim.peak_in_flight[s] == std::min(2 * (c.p - s) - 1, c.m));
      } else if (c.kind == schedule_kind::zero_bubble) {  // plus 2 s pending weight passes
        CHECK(sim.peak_in_flight[s] <= std::min(2 * c.p - 1, c.m));
        CHECK(sim.peak_in_flight[s] == std::min(2 * c.p - 1, c.m));
        CHECK(sim.peak_in_flight[s] == held_from_list(make_schedule(c.kind, s, c.p, c.m)));
      } else {
        CHECK(sim.peak_in_flight[s] <= c.p - s);
        CHECK(sim.peak_in_flight[s] == std::min(c.p - s, c.m));
      }
    }
  }
}

TEST_CASE("with equal unit costs the bubble is p-1 over m+p-1 for gpipe and 1f1b") {
  // Eager 1F1B reaches it only with sends that do not wait for their receive (async, below): in
  // Megatron's batches each early send waits for a receive its peer posts a step later. So does
  // zero-bubble when its weight passes cost nothing (cost.weight = 0: eager 1F1B's timing).
  for (const auto& c : all_combos()) {
    if (c.kind == schedule_kind::interleaved) continue;
    INFO(name_of(c));
    const auto mode = eager_links(c.kind) ? p2p_mode::async : p2p_mode::batched;
    auto sim = simulate(make_schedules(c.kind, c.p, c.m), {1.0, 1.0, 0.0}, mode);
    REQUIRE(sim.ok());
    CHECK(sim.makespan == 2.0 * (c.m + c.p - 1));
    CHECK(sim.bubble_fraction == Approx(double(c.p - 1) / (c.m + c.p - 1)).epsilon(1e-12));
    for (int s = 0; s < c.p; ++s) CHECK(sim.idle[s] == 2.0 * (c.p - 1));
  }
}

TEST_CASE("interleaving v chunks divides the bubble time by v") {
  // Narayanan et al. 2021: a stage's bubble is (p-1)(tf+tb) without interleaving and
  // (p-1)(tf+tb)/v with v chunks of 1/v of the layers each, so the bubble fraction drops from
  // (p-1)/(m+p-1) to (p-1)/(v m+p-1).
  for (const auto& c : all_combos()) {
    if (c.kind != schedule_kind::interleaved) continue;
    INFO(name_of(c));
    const double chunk = 1.0 / c.v;
    auto inter = simulate(make_schedules(c.kind, c.p, c.m, c.v), {chunk, chunk, 0.0});
    auto plain = simulate(make_schedules(schedule_kind::one_f_one_b, c.p, c.m), {1.0, 1.0, 0.0});
    REQUIRE(inter.ok());
    REQUIRE(plain.ok());
    CHECK(inter.makespan == Approx(2.0 * c.m + 2.0 * (c.p - 1) / c.v).epsilon(1e-12));
    CHECK(inter.bubble_fraction == Approx(double(c.p - 1) / (c.v * c.m + c.p - 1)).epsilon(1e-12));
    for (int s = 0; s < c.p; ++s)
      CHECK(inter.idle[s] == Approx(plain.idle[s] / c.v).epsilon(1e-12));
  }
}

TEST_CASE("the warmup counts follow Megatron's formulas") {
  CHECK(warmup_forwards(schedule_kind::one_f_one_b, 0, 4, 8) == 3);
  CHECK(warmup_forwards(schedule_kind::one_f_one_b, 3, 4, 8) == 0);
  CHECK(warmup_forwards(schedule_kind::one_f_one_b, 0, 4, 2) == 2);
  CHECK(warmup_forwards(schedule_kind::gpipe, 1, 4, 8) == 8);
  // (p - s - 1) * 2 + (v - 1) * p, capped at m * v; all m * v when m == p.
  CHECK(warmup_forwards(schedule_kind::interleaved, 0, 4, 8, 2) == 10);
  CHECK(warmup_forwards(schedule_kind::interleaved, 3, 4, 8, 2) == 4);
  CHECK(warmup_forwards(schedule_kind::interleaved, 0, 4, 4, 2) == 8);
  CHECK(warmup_forwards(schedule_kind::interleaved, 0, 2, 2, 3) == 6);
  CHECK(warmup_forwards(schedule_kind::interleaved, 0, 8, 16, 2) == 22);
  // The lists run that many forwards, plus the first steady-state one, before any backward.
  for (const auto& c : all_combos()) {
    INFO(name_of(c));
    for (int s = 0; s < c.p; ++s) {
      const auto list = make_schedule(c.kind, s, c.p, c.m, c.v);
      int forwards = 0;
      for (const auto& a : list) {
        if (a.kind == action_kind::backward) break;
        forwards += a.kind == action_kind::forward;
      }
      const int w = warmup_forwards(c.kind, s, c.p, c.m, c.v);
      CHECK(forwards == std::min(w + 1, c.m * c.v));
      if (c.kind == schedule_kind::zero_bubble)
        CHECK(w == warmup_forwards(schedule_kind::eager_1f1b, s, c.p, c.m));
    }
  }
}

TEST_CASE("interleaved forwards follow Megatron's chunk and microbatch order") {
  // p = 2, v = 2, m = 4: forward k runs chunk (k mod 4) / 2 on microbatch (k / 4) * 2 + k mod 2.
  const auto list = make_schedule(schedule_kind::interleaved, 0, 2, 4, 2);
  std::vector<std::pair<int, int>> fwd, bwd;
  for (const auto& a : list) {
    if (a.kind == action_kind::forward) fwd.emplace_back(a.microbatch, a.chunk);
    if (a.kind == action_kind::backward) bwd.emplace_back(a.microbatch, a.chunk);
  }
  using v = std::vector<std::pair<int, int>>;
  CHECK(fwd == v{{0, 0}, {1, 0}, {0, 1}, {1, 1}, {2, 0}, {3, 0}, {2, 1}, {3, 1}});
  CHECK(bwd == v{{0, 1}, {1, 1}, {0, 0}, {1, 0}, {2, 1}, {3, 1}, {2, 0}, {3, 0}});
}

TEST_CASE("the 1f1b timeline matches the figure of Narayanan et al") {
  // Four stages, eight microbatches, forward and backward one unit each (their Figure 3 with the
  // backward drawn as long as the forward).
  auto lists = make_schedules(schedule_kind::one_f_one_b, 4, 8);
  auto sim = simulate(lists, {});
  REQUIRE(sim.ok());
  const std::string want =
      "stage 0 |F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7 \n"
      "stage 1 |.  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .  \n"
      "stage 2 |.  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .  \n"
      "stage 3 |.  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .  \n";
  CHECK(timeline(lists, sim) == want);
}

TEST_CASE("transfers cost p2p time on the critical path") {
  // Two stages, one microbatch: F0 | send | F0 B0 | send | B0.
  auto sim = simulate(make_schedules(schedule_kind::one_f_one_b, 2, 1), {1.0, 2.0, 0.25});
  REQUIRE(sim.ok());
  CHECK(sim.makespan == 1.0 + 0.25 + 1.0 + 2.0 + 0.25 + 2.0);
  CHECK(sim.busy[0] == 3.0);
  CHECK(sim.idle[1] == sim.makespan - 3.0);
  CHECK(sim.finish[1].back() == 1.0 + 0.25 + 1.0 + 2.0 + 0.25);  // its last send
}

TEST_CASE("make_schedule rejects combinations it cannot schedule") {
  auto says = [](auto f, const std::string& what) {
    try {
      f();
      FAIL("no error; expected: " << what);
    } catch (const std::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains(what));
    }
  };
  says([] { make_schedule(schedule_kind::one_f_one_b, 4, 4, 8); }, "stage = 4");
  says([] { make_schedule(schedule_kind::gpipe, 0, 0, 8); }, "stages = 0");
  says([] { make_schedule(schedule_kind::gpipe, 0, 2, 0); }, "microbatches = 0");
  says([] { make_schedule(schedule_kind::one_f_one_b, 0, 2, 4, 2); }, "virtual_stages = 2");
  says([] { make_schedule(schedule_kind::zero_bubble, 1, 2, 4, 2); },
       "virtual_stages = 2 needs the interleaved schedule, not zero-bubble");
  says([] { make_schedule(schedule_kind::interleaved, 0, 4, 6, 2); }, "multiple of stages");
  says([] { make_schedule(schedule_kind::interleaved, 0, 4, 8, 1); }, "virtual_stages >= 2");
  says([] { make_schedule(schedule_kind::interleaved, 0, 1, 4, 2); }, "stages >= 2");
}

TEST_CASE("eager 1f1b and zero-bubble deadlock when every transfer blocks on its own") {
  for (auto kind : {schedule_kind::eager_1f1b, schedule_kind::zero_bubble}) {
    auto sim = simulate(make_schedules(kind, 2, 4), {}, p2p_mode::blocking);
    CHECK_THAT(sim.error, Catch::Contains("deadlock: stage 0"));
  }
}

TEST_CASE("eager 1f1b takes the transfers off the steady state") {
  // Run as pipeline_runner runs a list (sends buffered, receives posted where the list has them,
  // a compute waiting only for its own input), 1F1B puts transfers on the critical path of its
  // steady state: a stage's backward waits for the gradient its successor has just sent, and the
  // successor's forward after next for the activation the stage sends after that backward. With
  // one spare microbatch per link the activation is sent a forward and a backward before it is
  // needed, so only the ramp pays for transfers: the makespan is the unit-cost one plus one
  // transfer per link each way, and 1F1B's is at least one transfer per steady-state step longer.
  const double f = 1.0, b = 2.0, l = 0.25;
  for (int p = 2; p <= 8; ++p)
    for (int m = p; m <= 16; ++m) {
      INFO("p=" << p << " m=" << m);
      auto eager =
          simulate(make_schedules(schedule_kind::eager_1f1b, p, m), {f, b, l}, p2p_mode::async);
      auto plain =
          simulate(make_schedules(schedule_kind::one_f_one_b, p, m), {f, b, l}, p2p_mode::async);
      REQUIRE(eager.ok());
      REQUIRE(plain.ok());
      CHECK(eager.makespan == Approx((m + p - 1) * (f + b) + 2 * (p - 1) * l).epsilon(1e-12));
      CHECK(plain.makespan >= eager.makespan + (m - 2) * l - 1e-12);
      // Free transfers: the same makespan and bubble as 1F1B, (p - 1) / (m + p - 1).
      auto free =
          simulate(make_schedules(schedule_kind::eager_1f1b, p, m), {f, b, 0.0}, p2p_mode::async);
      CHECK(free.makespan == Approx((m + p - 1) * (f + b)).epsilon(1e-12));
      CHECK(free.bubble_fraction == Approx(double(p - 1) / (m + p - 1)).epsilon(1e-12));
    }
}

TEST_CASE("the async simulation reports a receive that no stage sends as a deadlock") {
  auto lists = make_schedules(schedule_kind::one_f_one_b, 2, 2);
  // Stage 0 never sends microbatch 1's activation: stage 1 waits for it forever.
  for (auto it = lists[0].begin(); it != lists[0].end(); ++it)
    if (it->kind == action_kind::send_activation && it->microbatch == 1) {
      lists[0].erase(it);
      break;
    }
  auto sim = simulate(lists, {}, p2p_mode::async);
  CHECK_THAT(sim.error, Catch::Contains("stage 1 action 5 (forward microbatch 1 chunk 0)") &&
                            Catch::Contains("is never sent"));
}

TEST_CASE("zero-bubble lists are eager 1f1b lists with deferred weight passes") {
  // The example of the task: p = 2, stage 1 (d = 2), eight microbatches.
  CHECK(computes(make_schedule(schedule_kind::zero_bubble, 1, 2, 8)) ==
        "F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 F4 B4 W2 F5 B5 W3 F6 B6 W4 F7 B7 W5 W6 W7");
  for (int p = 1; p <= 8; ++p)
    for (int m = 1; m <= 16; ++m) {
      INFO("p=" << p << " m=" << m);
      const auto zero = make_schedules(schedule_kind::zero_bubble, p, m);
      const auto eager = make_schedules(schedule_kind::eager_1f1b, p, m);
      CHECK(zero[0] == eager[0]);  // the first stage does not split
      for (int s = 0; s < p; ++s) {
        INFO("stage " << s);
        const auto& list = zero[s];
        std::vector<action> without;
        for (const auto& a : list)
          if (a.kind != action_kind::weight) without.push_back(a);
        CHECK(without == eager[s]);
        // Weight pass j: right after the transfer batch that follows backward j + 2 s, or, when
        // there is no such backward, after the last backward's batch; in microbatch order.
        const int d = 2 * s;
        int next = 0;
        std::size_t prev = list.size();  // the last compute action so far
        for (std::size_t i = 0; i < list.size(); ++i) {
          const action& a = list[i];
          if (a.kind == action_kind::weight) {
            const int j = a.microbatch;
            REQUIRE(j == next++);
            REQUIRE(prev < list.size());
            const action& before = list[prev];
            if (j + d < m) {
              CHECK(before.kind == action_kind::backward);
              CHECK(before.microbatch == j + d);
            } else {
              CHECK(before.kind == (j == 0 ? action_kind::backward : action_kind::weight));
              CHECK(before.microbatch == (j == 0 ? m - 1 : j - 1));
            }
            CHECK((i + 1 == list.size() || is_compute(list[i + 1].kind)));  // the batch is over
          }
          if (is_compute(a.kind)) prev = i;
        }
        CHECK(next == (s == 0 ? 0 : m));
      }
    }
}

TEST_CASE("zero-bubble beats eager 1f1b when the backward outlasts the forward") {
  // Forward 1, full backward 2 split into B = 1 and W = 1, free transfers, async. By hand for
  // p = 2, m = 8 (stage 0: eager, warmup 2, full backwards; stage 1: warmup 0, d = 2):
  //   stage 0: F0 F1 F2 B0 F3 B1 ... F7 B5 B6 B7, 8 x 1 + 8 x 2 = 24 of work. Activation j leaves
  //     at the end of F(j): 1, 2, 3 for j <= 2, then 3 j - 3 (F(j) runs in [3 j - 4, 3 j - 3]).
  //     B(k) starts at 3 + 3 k for k <= 5 (after F(k + 2)), B6 at 20 and B7 at 22.
  //   stage 1: F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 ... F7 B7 W5 W6 W7, 8 x 3 = 24 of work, starts at 1
  //     (activation 0). Run back to back from there: F0 [1,2] B0 [2,3] F1 [3,4] B1 [4,5] F2 [5,6]
  //     B2 [6,7] W0 [7,8], then F(j) [3 j - 1, 3 j] B(j) [3 j, 3 j + 1] W(j - 2) for j >= 3.
  //   Nobody waits: activation j (3 j - 3) is there before F(j) starts (3 j - 1), gradient k
  //   (3 k + 1; 3, 5, 7 for k <= 2) before stage 0's B(k) starts (3 + 3 k; 20 and 22 for k = 6, 7:
  //   gradients 19 and 22). Stage 0 ends at 24, stage 1 at 1 + 24 = 25: makespan 25, idle 1 on
  //   each stage, bubble 2 / 50. Eager 1F1B: (m + p - 1)(F + B + W) = 27, bubble 1 / 9.
  const cost c{.forward = 1.0, .backward = 2.0, .p2p = 0.0, .weight = 1.0};
  auto zero = simulate(make_schedules(schedule_kind::zero_bubble, 2, 8), c, p2p_mode::async);
  auto eager = simulate(make_schedules(schedule_kind::eager_1f1b, 2, 8), c, p2p_mode::async);
  REQUIRE(zero.ok());
  REQUIRE(eager.ok());
  CHECK(zero.makespan == 25.0);
  CHECK(zero.makespan < eager.makespan);
  CHECK(zero.bubble_fraction < 1.0 / 9.0);
  CHECK(zero.bubble_fraction == Approx(2.0 / 50.0).epsilon(1e-12));
  CHECK(zero.busy == std::vector<double>{24.0, 24.0});
  // Smaller than eager's everywhere, and never below the last stage's start plus its work.
  for (int p = 2; p <= 4; ++p)
    for (int m : {4, 8, 16}) {
      INFO("p=" << p << " m=" << m);
      auto z = simulate(make_schedules(schedule_kind::zero_bubble, p, m), c, p2p_mode::async);
      auto e = simulate(make_schedules(schedule_kind::eager_1f1b, p, m), c, p2p_mode::async);
      REQUIRE(z.ok());
      REQUIRE(e.ok());
      CHECK(z.makespan < e.makespan);
      CHECK(z.makespan >= m * (c.forward + c.backward) + (p - 1) * c.forward);
    }
}

TEST_CASE("with unit forward backward and weight passes zero-bubble pays only the forward ramp") {
  // Every stage runs one microbatch per F + B + W; stage s's cycle runs 2 W ahead of stage
  // s - 1's, which leaves the gradient F - B + 2 W = 2 and the activation 2 B = 2 of slack on each
  // link (pipeline.hpp). So once the last stage has its first input, at (p - 1)(F + l), it never
  // waits, and the makespan is that plus its m (F + B + W) of work, for transfers of l below the
  // slack. Checked where every stage reaches its steady state (m >= 2 p - 1).
  for (double l : {0.0, 0.25})
    for (int p = 2; p <= 8; ++p)
      for (int m = 2 * p - 1; m <= 16; ++m) {
        INFO("p=" << p << " m=" << m << " l=" << l);
        const cost c{.forward = 1.0, .backward = 2.0, .p2p = l, .weight = 1.0};
        auto sim = simulate(make_schedules(schedule_kind::zero_bubble, p, m), c, p2p_mode::async);
        REQUIRE(sim.ok());
        CHECK(sim.makespan == Approx(3.0 * m + (p - 1) * (1.0 + l)).epsilon(1e-12));
      }
}
