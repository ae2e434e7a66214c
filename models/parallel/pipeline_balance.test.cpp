// Pipeline stage balance, not a test: the compute of each stage of gpt2-demo at pp 2 (4 x 128,
// vocabulary 256, one row of 128 tokens per microbatch, 8 microbatches, 1F1B) timed alone, one
// stage after the other on one compute thread, in the order its action list runs it (so stage 0
// pays its activation stash as it does in a step). Prints per stage the low quartile of forward and
// backward (and, under zero-bubble, weight pass) of a microbatch and of the step, their ratio, and
// the bubble the schedule implies for those times (the replay of scripts/bench/pipe_trace.py, free
// transfers), for 1F1B and for zero-bubble (stage 1's backwards split).
// Run: troupe_models_tests "[.pipe_balance]".
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <map>
#include <string>
#include <vector>

#include "models/gpt.hpp"
#include "models/parallel/gpt_stage.hpp"
#include "models/parallel/pipeline_runner.hpp"
#include "models/parallel/testing.hpp"
#include "scheduler/pipeline.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;

namespace {

// CPU time of the calling thread: what the stage computes, without the time other tenants of the
// machine hold the core (wall time is meaningless under a load of 10 on 2 cores).
double thread_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// The low quartile: robust against the other tenants of a shared machine stealing the core.
double low_quartile(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 4];
}

// Replays the compute actions of every stage with the given durations and free transfers; returns
// idle / (stages x makespan), the definition (p - 1) / (m + p - 1) uses.
double replay_bubble(const std::vector<std::vector<scheduler::action>>& lists,
                     const std::vector<double>& fwd, const std::vector<double>& bwd,
                     const std::vector<double>& wgt) {
  const int p = static_cast<int>(lists.size());
  std::map<std::pair<int, int>, double> done;  // (kind 0 f / 1 b, mb * p + stage) -> end
  std::vector<std::size_t> pos(static_cast<std::size_t>(p), 0);
  std::vector<double> clock(static_cast<std::size_t>(p), 0.0), busy(clock);
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s)
      while (pos[s] < lists[s].size()) {
        const auto& a = lists[s][pos[s]];
        if (!scheduler::is_compute(a.kind)) {
          ++pos[s];
          continue;
        }
        const bool f = a.kind == scheduler::action_kind::forward;
        const bool w = a.kind == scheduler::action_kind::weight;  // after its backward, here
        std::pair<int, int> dep{-1, 0};
        if (f && s > 0) dep = {0, a.microbatch * p + s - 1};
        if (!f && !w)
          dep = s + 1 < p ? std::pair{1, a.microbatch * p + s + 1}
                          : std::pair{0, a.microbatch * p + s};
        double ready = 0;
        if (dep.first >= 0) {
          auto it = done.find(dep);
          if (it == done.end()) break;
          ready = it->second;
        }
        const double d = f ? fwd[s] : w ? wgt[s] : bwd[s];
        clock[s] = std::max(clock[s], ready) + d;
        busy[s] += d;
        if (!w) done[{f ? 0 : 1, a.microbatch * p + s}] = clock[s];
        ++pos[s];
        progress = true;
      }
  }
  const double span = *std::max_element(clock.begin(), clock.end());
  double idle = 0;
  for (int s = 0; s < p; ++s) idle += span - busy[s];
  return idle / (p * span);
}

// Deterministic values in [-scale, scale), like activations rather than constants (a constant row
// would make the layer norms degenerate).
void fill_pattern(const tensor& t, int seed, float scale) {
  std::uint32_t x = 2463534242u + static_cast<std::uint32_t>(seed) * 7919u;
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    p[i] = scale * (static_cast<float>(x % 2000u) / 1000.0f - 1.0f);
  }
}

void balance(scheduler::schedule_kind kind);

}  // namespace

TEST_CASE("Pipeline stage compute balance of gpt2-demo", "[.pipe_balance]") {
  troupe::parallel::set_num_threads(1);
  for (auto kind : {scheduler::schedule_kind::one_f_one_b, scheduler::schedule_kind::zero_bubble}) {
    std::printf("%s:\n", std::string(scheduler::name(kind)).c_str());
    balance(kind);
  }
}

namespace {

void balance(scheduler::schedule_kind kind) {
  const gpt_config cfg = testing::gpt_shape(256, 128, 128, 4, 4);
  const batch_dims dims{1, 128};
  const int p = 2, m = 8, steps = 40;
  scheduler::parallel_plan plan;
  plan.pp = p;
  plan.schedule = kind;
  plan.microbatches = m;
  const scheduler::model_shape shape{.layers = cfg.n_layer,
                                     .heads = cfg.n_head,
                                     .kv_heads = cfg.n_head,
                                     .hidden = cfg.dim,
                                     .vocab = cfg.vocab,
                                     .seq = dims.seq,
                                     .batch = m};
  const auto lists = scheduler::make_schedules(plan.schedule, p, m, 1);
  auto ids = empty({dims.batch, dims.seq}, dtype::i32);
  for (std::int64_t i = 0; i < ids.numel(); ++i)
    ids.data_as<std::int32_t>()[i] = static_cast<std::int32_t>((i * 31 + 7) % 256);
  std::vector<double> fwd(p), bwd(p), wgt(p, 0.0), step(p);
  std::vector<char> split(p, 0);
  for (int s = 0; s < p; ++s) {
    gpt_stage st(cfg, dims, stage_options::of(plan, s, shape));
    st.init_weights(1);
    std::vector<owned_tensor> in, out, dy, dx;
    for (int k = 0; k < m; ++k) {
      for (auto* v : {&in, &out, &dy, &dx}) v->push_back(empty(st.boundary(), dtype::f32));
      fill_pattern(in.back(), k, 1.0f);
      fill_pattern(dy.back(), k + m, 1e-3f);
    }
    std::vector<double> f, b, w, total;
    for (const auto& a : lists[s]) split[s] |= a.kind == scheduler::action_kind::weight;
    for (int t = 0; t < steps; ++t) {
      st.memory().zero_grads();
      st.begin_step(m);
      double sum = 0;
      for (const auto& a : lists[s]) {
        if (!scheduler::is_compute(a.kind)) continue;
        const int k = a.microbatch;
        const double t0 = thread_cpu_seconds();
        if (a.kind == scheduler::action_kind::forward) {
          st.forward(k, 0, st.holds_first(0) ? ids.view() : in[k].view(), ids, 1.0 / m,
                     st.holds_last(0) ? tensor{} : out[k].view());
        } else if (a.kind == scheduler::action_kind::backward) {
          st.backward(k, 0, st.holds_last(0) ? tensor{} : dy[k].view(),
                      st.holds_first(0) ? tensor{} : dx[k].view(), {}, split[s] != 0);
        } else {
          st.weight(k, 0, {});
        }
        const double d = thread_cpu_seconds() - t0;
        sum += d;
        if (t > 0)
          (a.kind == scheduler::action_kind::forward    ? f
           : a.kind == scheduler::action_kind::backward ? b
                                                        : w)
              .push_back(d);
      }
      if (t > 0) total.push_back(sum);
    }
    fwd[s] = low_quartile(f);
    bwd[s] = low_quartile(b);
    wgt[s] = low_quartile(w);
    step[s] = low_quartile(total);
    std::printf(
        "stage %d (blocks %lld..%lld): forward %.3f ms, backward %.3f ms, weight pass %.3f ms, "
        "step %.2f ms\n",
        s, static_cast<long long>(st.first_block(0)), static_cast<long long>(st.end_block(0) - 1),
        fwd[s] * 1e3, bwd[s] * 1e3, wgt[s] * 1e3, step[s] * 1e3);
  }
  std::printf(
      "stage 1 / stage 0: forward %.3f, backward %.3f, step %.3f; replay bubble "
      "%.1f%% (1F1B theory %.1f%%)\n",
      fwd[1] / fwd[0], bwd[1] / bwd[0], step[1] / step[0],
      100 * replay_bubble(lists, fwd, bwd, wgt),
      100 * pipeline_runner::ideal_bubble_fraction(p, m));
}

}  // namespace
