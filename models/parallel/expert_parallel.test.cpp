// Expert parallelism (expert_parallel.hpp) against the single-process trainer at the same tokens
// per step: ep 2 (2 ranks), dp 4 x ep 2 (4 ranks: two expert-parallel groups, each expert on two
// ranks), ep 4 (one expert per rank), and ep 2 with ZeRO 1. Ranks are threads of one process
// (collective/local), each with its own piece of a tiny Mixtral (named size mixtral-tiny: 4 experts
// top-2), the aux loss off so the loss is a mean over tokens and the plan must equal the single
// process up to f32 summation order (tests/rounding.hpp, exact_run.hpp: losses and gradient norms
// per step within trajectory_k, final weights within default_k of the single process's own error
// against the same run in f64). A plan that loses an exchange, a row or a reduction is off by
// O(lr) in its weights.
//
// Starvation: weights and data made so that the router sends no token of one expert-parallel group
// to half of the experts, while the other group feeds them (each expert is starved on one of its
// two ranks), and so that no token of the job reaches two experts at all; neither hangs, and every
// rank's weights still equal the single process's.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/causal_lm.hpp"
#include "models/parallel/exact_run.hpp"
#include "models/parallel/expert_parallel.hpp"
#include "models/parallel/hybrid.hpp"
#include "models/parallel/testing.hpp"
#include "models/trainer.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::models::parallel::ep_groups;
using troupe::models::parallel::ep_step_load;
using troupe::models::parallel::ep_trainer;
using troupe::models::testing::as_f64;
using troupe::models::testing::check_as_accurate;
using troupe::models::testing::copy_params_by_name;
using troupe::models::testing::exact_run;
using troupe::models::testing::exact_training;
using troupe::models::testing::param_slot;

namespace {

train_config tiny_run() {
  train_config c;
  c.steps = 5;
  c.batch = 4;
  c.seq = 8;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.5;
  c.eps = 1e-6;  // as data_parallel.test.cpp: keeps Adam's amplified rounding noise small
  return c;
}

hf::model_config tiny_moe(bool aux = false) {
  auto m = named_model_config("mixtral-tiny", 29).value();
  std::get<hf::moe_config>(m).output_router_logits = aux;
  return m;
}

// The single-process run in f32 and its f64 twin (both kept: the final weights are compared by
// name, a rank holding only some experts).
struct reference {
  std::unique_ptr<causal_lm> start, f32, f64;  // the weights before training, after it in f32, f64
  std::vector<step_result> steps;
  exact_run exact;
};

// `prepare` sets the f32 model's weights (after init_weights(5)); the f64 model gets them widened.
reference single_process(const train_config& c, const trainer::batch_source& rows,
                         const std::function<void(causal_lm&)>& prepare = {},
                         const hf::model_config& model = tiny_moe()) {
  reference r;
  r.f32 = make_causal_lm(model, {c.batch, c.seq});
  r.f32->init_weights(5);
  if (prepare) prepare(*r.f32);
  r.f64 = make_causal_lm(model, {c.batch, c.seq}, dtype::f64);
  copy_params_by_name(r.f32->slots(), r.f64->slots());
  r.start = make_causal_lm(model, {1, c.seq});
  copy_params_by_name(r.f32->slots(), r.start->slots());
  r.exact = exact_training(*r.f64, c, rows);  // before the f32 run changes the weights
  trainer t(*r.f32, c);
  for (int s = 0; s < c.steps; ++s) r.steps.push_back(t.step(rows));
  return r;
}

struct rank_run {
  std::vector<step_result> steps;
  std::map<std::string, std::vector<float>> params;  // by name: this rank's parameters
  std::vector<ep_step_load> loads;
  std::int64_t optimizer_elements = 0, param_elements = 0;
};

// dp ranks (threads) with expert-parallel degree ep: ep groups of consecutive ranks, expert data
// parallel groups of ranks with the same d % ep. `from`: the weights to start from (by name),
// else init_weights(5) on each rank's piece.
std::vector<rank_run> expert_parallel(train_config c, int dp, int ep, int zero,
                                      const trainer::batch_source& rows,
                                      const causal_lm* from = nullptr,
                                      const hf::model_config& model = tiny_moe()) {
  c.plan.dp = dp;
  c.plan.ep = ep;
  c.plan.zero = zero;
  auto dp_comms = collective::make_local_group(dp);
  std::vector<std::vector<std::unique_ptr<collective::communicator>>> ep_comms, edp_comms;
  for (int i = 0; i < dp / ep; ++i) ep_comms.push_back(collective::make_local_group(ep));
  for (int i = 0; i < ep; ++i) edp_comms.push_back(collective::make_local_group(dp / ep));
  std::vector<collective::communicator*> all;
  for (auto& x : dp_comms) all.push_back(x.get());
  for (auto& g : ep_comms)
    for (auto& x : g) all.push_back(x.get());
  for (auto& g : edp_comms)
    for (auto& x : g) all.push_back(x.get());
  std::vector<rank_run> out(dp);
  testing::run_threads(
      dp,
      [&](int d) {
        ep_groups g{dp_comms[d].get(), ep_comms[d / ep][d % ep].get(),
                    edp_comms[d % ep][d / ep].get()};
        ep_trainer t(model, c, g);
        if (from != nullptr)
          copy_params_by_name(from->slots(), t.model().slots());
        else
          t.model().init_weights(5);
        for (int s = 0; s < c.steps; ++s) {
          out[d].steps.push_back(t.step(rows));
          out[d].loads.push_back(t.last_load());
        }
        for (const auto& s : t.model().slots().slots())
          if (s.kind == slot_kind::param) out[d].params[s.name] = testing::flat(*s.field);
        out[d].optimizer_elements = t.optimizer_elements();
        out[d].param_elements = t.model().memory().params().numel();
      },
      all);
  return out;
}

// Every rank's losses and norms per step, and its final weights by name, as accurate as the single
// process's (exact_run.hpp); ranks holding a parameter hold it bit for bit alike (they apply the
// same reduced gradient with the same update).
void check_ranks(const std::vector<rank_run>& runs, const reference& ref) {
  for (std::size_t d = 0; d < runs.size(); ++d) {
    INFO("dp rank " << d);
    check_as_accurate(runs[d].steps, ref.steps, ref.exact);
    std::vector<double> got, want, exact;
    for (const auto& [name, values] : runs[d].params) {
      const tensor_slot* r = param_slot(ref.f32->slots(), name);
      const tensor_slot* x = param_slot(ref.f64->slots(), name);
      REQUIRE(r != nullptr);
      REQUIRE(x != nullptr);
      const auto rv = as_f64(*r->field), xv = as_f64(*x->field);
      got.insert(got.end(), values.begin(), values.end());
      want.insert(want.end(), rv.begin(), rv.end());
      exact.insert(exact.end(), xv.begin(), xv.end());
    }
    const auto v = tests::as_accurate_as(got, want, exact);
    INFO("weights: " << v.str());
    CHECK(v.ok());
    if (std::getenv("TROUPE_ROUNDING_REPORT") != nullptr)
      std::printf("rounding ratio of dp rank %zu's weights: %.3g\n", d, v.ratio());
    for (std::size_t o = 0; o < d; ++o)
      for (const auto& [name, values] : runs[d].params)
        if (auto it = runs[o].params.find(name); it != runs[o].params.end()) {
          INFO(name << " on dp ranks " << o << " and " << d);
          const bool same = it->second == values;  // (not expanded: 10^5 floats)
          CHECK(same);
        }
  }
}

std::int64_t sum(const std::vector<std::int64_t>& v) {
  std::int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}

}  // namespace

TEST_CASE(
    "Expert parallel training at ep 2 dp 4 x ep 2 ep 4 and with ZeRO 1 and 2 equals the "
    "single process trainer",
    "[parallel]") {
  const train_config c = tiny_run();
  const auto ref = single_process(c, testing::synthetic_rows);
  const std::int64_t whole = ref.f32->memory().params().numel();
  struct plan {
    int dp, ep, zero;
  };
  // (dp 2, ep 1: the same engine without expert parallelism, experts reduced over all of dp.)
  for (plan p : {plan{2, 2, 0}, plan{4, 2, 0}, plan{4, 4, 0}, plan{2, 2, 1}, plan{4, 2, 1},
                 plan{2, 1, 0}, plan{2, 2, 2}, plan{4, 2, 2}}) {
    INFO("dp " << p.dp << " ep " << p.ep << " zero " << p.zero);
    const auto runs = expert_parallel(c, p.dp, p.ep, p.zero, testing::synthetic_rows);
    check_ranks(runs, ref);
    for (const auto& r : runs) {
      // Each rank holds 1/ep of the experts: fewer parameters than the whole model, and under
      // ZeRO 1 the moments of 1/dp of the non-expert parameters and 1/(dp/ep) of its experts'
      // (each range's chunk rounded up: a few elements more).
      CHECK((r.param_elements < whole || p.ep == 1));
      if (p.zero == 0) CHECK(r.optimizer_elements == r.param_elements);
      if (p.zero >= 1) CHECK(r.optimizer_elements < r.param_elements);
      if (p.zero >= 1 && p.dp / p.ep >= 2) CHECK(r.optimizer_elements <= r.param_elements / 2 + 64);
      // The load: every choice of the job counted once (layers x tokens x top_k), and the rows
      // this rank's experts served sum, over the group, to the group's choices.
      const auto& load = r.loads.back();
      CHECK(sum(load.tokens) == 4 * c.batch * c.seq * 2);
      CHECK(load.imbalance >= 1.0);
      CHECK(load.imbalance <= 2.0);  // n_expert / top_k
      CHECK(static_cast<int>(load.served.size()) == 4 / p.ep);
    }
    // Each expert-parallel group's ranks together served all of its tokens' choices.
    for (int g = 0; g < p.dp / p.ep; ++g) {
      std::int64_t served = 0;
      for (int i = 0; i < p.ep; ++i) served += sum(runs[g * p.ep + i].loads.back().served);
      CHECK(served == 4 * (c.batch / p.dp) * p.ep * c.seq * 2);
    }
  }
}

TEST_CASE("Expert parallel training accumulates train.grad_accum draws like the single process",
          "[parallel]") {
  train_config c = tiny_run();
  c.grad_accum = 2;
  c.steps = 3;
  const auto ref = single_process(c, testing::synthetic_rows);
  check_ranks(expert_parallel(c, 4, 2, 1, testing::synthetic_rows), ref);
}

TEST_CASE(
    "Expert parallel Qwen2-MoE with its shared expert and unnormalised weights equals the "
    "single process trainer",
    "[parallel]") {
  // The shared expert and its gate are on every rank (reduced over dp like attention); the routing
  // weights are the raw top-k probabilities (norm_topk_prob false): both reach the experts' rows
  // and their gradients through the same exchanges.
  hf::moe_config q = std::get<hf::moe_config>(tiny_moe());
  q.model_type = "qwen2_moe";
  q.moe_intermediate_size = 96;
  q.shared_expert_intermediate_size = 160;
  q.norm_topk_prob = false;
  const hf::model_config m(q);
  const train_config c = tiny_run();
  const auto ref = single_process(c, testing::synthetic_rows, {}, m);
  check_ranks(expert_parallel(c, 4, 2, 0, testing::synthetic_rows, nullptr, m), ref);
}

TEST_CASE("Expert parallel ranks with the aux loss on keep the same weights", "[parallel]") {
  // Each rank's aux loss is its own rows' (as under dp, moe_data_parallel.test.cpp), so the run is
  // not the single process's; the ranks must still agree on every parameter they share, and the
  // losses differ by a fraction of the aux term (coefficient 0.01 times ~2).
  const train_config c = tiny_run();
  const auto ref = single_process(c, testing::synthetic_rows, {}, tiny_moe(true));
  const auto runs = expert_parallel(c, 4, 2, 0, testing::synthetic_rows, nullptr, tiny_moe(true));
  double apart = 0;
  for (std::size_t d = 0; d < runs.size(); ++d) {
    for (int s = 0; s < c.steps; ++s) {
      CHECK(runs[d].steps[s].loss == runs[0].steps[s].loss);
      apart = std::max(apart, std::abs(runs[d].steps[s].loss - ref.steps[s].loss));
    }
    for (std::size_t o = 0; o < d; ++o)
      for (const auto& [name, values] : runs[d].params)
        if (auto it = runs[o].params.find(name); it != runs[o].params.end()) {
          INFO(name << " on dp ranks " << o << " and " << d);
          const bool same = it->second == values;
          CHECK(same);
        }
  }
  CHECK(apart > 0);
  CHECK(apart < 0.01 * 2);
}

namespace {

// Weights under which the router's choice depends on the sign of a token's embedding in channel
// 0 alone: embed_tokens[t, 0] = +3 for t < 15, -3 else (the other channels ~0.02, so after RMSNorm
// channel 0 is ~+-11 and the rest ~0.1); no attention or expert output writes channel 0 (o_proj
// and every down_proj row 0 zero), so it stays the embedding's in every layer; each router's
// column 0 is (1, -1, 0.5, -0.5), which dominates its logits: tokens t < 15 choose experts 0 and
// 2, the others 1 and 3. Training moves these weights by ~lr per step, far from changing that.
void split_routing(causal_lm& m) {
  for (const auto& s : m.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    float* p = s.field->data_as<float>();
    const std::int64_t cols = s.field->size(-1);
    const std::string& n = s.name;
    if (n == "embed_tokens.weight") {
      for (std::int64_t t = 0; t < s.sizes[0]; ++t) p[t * cols] = t < 15 ? 3.0f : -3.0f;
    } else if (n.ends_with("self_attn.o_proj.weight") || n.ends_with("down_proj.weight")) {
      for (std::int64_t j = 0; j < cols; ++j) p[j] = 0.0f;
    } else if (n.ends_with("mlp.gate.weight")) {
      const float column[4] = {1.0f, -1.0f, 0.5f, -0.5f};
      for (std::int64_t e = 0; e < s.sizes[0]; ++e) p[e * cols] = column[e];
    }
  }
}

// Rows of tokens below 15 for samples below `low`, of tokens 15..28 for the others.
trainer::batch_source split_rows(int low) {
  return [low](std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
    rows.resize(static_cast<std::size_t>(batch) * seq);
    for (int b = 0; b < batch; ++b)
      for (int i = 0; i < seq; ++i) {
        const auto v = static_cast<std::int32_t>((draw * 7 + b * 5 + i * i * 3 + i) % 14);
        rows[static_cast<std::size_t>(b) * seq + i] = b < low ? v : 15 + v;
      }
  };
}

}  // namespace

TEST_CASE("An expert that no token of its rank's group chose still has its gradients reduced",
          "[parallel]") {
  const train_config c = tiny_run();
  SECTION("starved in one expert parallel group and fed by the other") {
    // dp 4 x ep 2: ranks 0 and 1 (samples 0 and 1, tokens < 15) route only to experts 0 and 2,
    // ranks 2 and 3 (samples 2 and 3) only to 1 and 3. Rank 0 holds experts 0 and 1, rank 2 the
    // same two: expert 1's gradient is zero on rank 0 and comes from rank 2 through their
    // expert-data-parallel reduction (and expert 0's the other way).
    const auto rows = split_rows(2);
    const auto ref = single_process(c, rows, split_routing);
    const auto runs = expert_parallel(c, 4, 2, 0, rows, ref.start.get());
    // The routing is what the weights were made for, at every step.
    for (int s = 0; s < c.steps; ++s) {
      INFO("step " << s);
      CHECK(runs[0].loads[s].served[0] > 0);
      CHECK(runs[0].loads[s].served[1] == 0);
      CHECK(runs[2].loads[s].served[0] == 0);
      CHECK(runs[2].loads[s].served[1] > 0);
      CHECK(runs[1].loads[s].served[1] == 0);  // expert 3 in group A
      CHECK(runs[3].loads[s].served[0] == 0);  // expert 2 in group B
      for (auto n : runs[0].loads[s].tokens) CHECK(n > 0);
    }
    check_ranks(runs, ref);
  }
  SECTION("chosen by no token of the job") {
    // ep 2: every token below 15, so experts 1 and 3 (one on each rank) run on no row at all.
    const auto rows = split_rows(4);
    const auto ref = single_process(c, rows, split_routing);
    const auto runs = expert_parallel(c, 2, 2, 0, rows, ref.start.get());
    for (int s = 0; s < c.steps; ++s) {
      const auto& l = runs[0].loads[s];
      CHECK(l.tokens[1] == 0);
      CHECK(l.tokens[3] == 0);
      CHECK(l.imbalance == 2.0);  // all on half the experts: n_expert / top_k
      CHECK(runs[0].loads[s].served[1] == 0);
      CHECK(runs[1].loads[s].served[1] == 0);
    }
    std::printf("expert parallel load, starved job, step %d: %s\n", static_cast<int>(c.steps),
                parallel::describe(runs[0].loads.back()).c_str());
    check_ranks(runs, ref);
  }
}

TEST_CASE("Expert parallel plans it cannot run are refused naming the setting",
          "[parallel][faults]") {
  auto one = collective::make_local_group(1);
  auto two = collective::make_local_group(2);
  const ep_groups g{two[0].get(), two[0].get(), one[0].get()};
  struct bad {
    const char* what;
    std::function<void(train_config&, hf::model_config&)> set;
    const char* names;
  };
  const std::vector<bad> cases = {
      {"a dense model",
       [](train_config&, hf::model_config& m) { m = named_model_config("llama-tiny", 29).value(); },
       "parallel.ep (--ep) 2 needs an MoE model"},
      {"ZeRO 3", [](train_config& c, hf::model_config&) { c.plan.zero = 3; }, "parallel.zero"},
      {"tp 2", [](train_config& c, hf::model_config&) { c.plan.tp = 2; }, "parallel.tp 2"},
      {"a capacity", [](train_config& c, hf::model_config&) { c.moe_capacity_factor = 1.25; },
       "model.moe_capacity_factor"},
      {"ep 3 of 4 experts",
       [](train_config& c, hf::model_config&) {
         c.plan.ep = 3;
         c.plan.dp = 3;
       },
       "parallel.ep = 3 does not divide experts = 4"},
  };
  for (const auto& b : cases) {
    train_config c = tiny_run();
    c.plan.dp = 2;
    c.plan.ep = 2;
    hf::model_config m = tiny_moe();
    b.set(c, m);
    // The plan is refused before any collective (ep_plan_problems), so one thread shows it.
    INFO(b.what);
    const std::string problems = parallel::ep_plan_problems(m, c);
    CHECK(problems.find(b.names) != std::string::npos);
    std::printf("faults: expert parallelism with %s -> refused: %s\n", b.what, problems.c_str());
  }
  // The engine itself refuses such a plan (here: ZeRO 3) with the same text.
  train_config c = tiny_run();
  c.plan.dp = 2, c.plan.ep = 2, c.plan.zero = 3;
  CHECK_THROWS_WITH(ep_trainer(tiny_moe(), c, g), Catch::Contains("parallel.zero (--zero) 3"));
  // troupe train's engine (hybrid.hpp) runs parallel.ep through ep_trainer
  // (tests/multirank/expert_parallel.test.cpp); a plan neither runs is refused before any
  // collective, naming the flags.
  c.plan.zero = 0;
  struct hybrid_bad {
    const char* what;
    std::function<void(train_config&)> set;
    bool moe;
    std::vector<const char*> names;
  };
  const std::vector<hybrid_bad> engine_cases = {
      {"a dense model", [](train_config&) {}, false, {"parallel.ep (--ep) 2 needs an MoE model"}},
      {"tp 2",
       [](train_config& t) { t.plan.tp = 2; },
       true,
       {"parallel.ep (--ep) 2", "parallel.tp (--tp) 2"}},
      {"pp 2 and ZeRO 1",  // ep x pp runs with ZeRO 0 (moe_pipeline.test.cpp)
       [](train_config& t) {
         t.plan.pp = 2;
         t.plan.zero = 1;
       },
       true,
       {"parallel.ep (--ep) 2", "parallel.pp (--pp) 2", "parallel.zero 0 (got 1)"}},
      {"ZeRO 3", [](train_config& t) { t.plan.zero = 3; }, true, {"parallel.zero (--zero) 3"}},
      {"bf16", [](train_config& t) { t.precision = "bf16"; }, true, {"train.precision bf16"}},
  };
  for (const auto& b : engine_cases) {
    INFO(b.what);
    train_config t = c;
    b.set(t);
    const hf::model_config m = b.moe ? tiny_moe() : named_model_config("llama-tiny", 29).value();
    collective::communicator* mp = t.plan.tp * t.plan.pp > 1 ? two[0].get() : one[0].get();
    parallel::hybrid_groups h{two[0].get(), t.plan.pp > 1 ? two[0].get() : one[0].get(),
                              t.plan.tp > 1 ? two[0].get() : one[0].get(), mp};
    h.ep = two[0].get();
    h.edp = one[0].get();
    try {
      parallel::hybrid_trainer engine(m, t, h);
      FAIL("the hybrid trainer accepted parallel.ep 2 with " << b.what);
    } catch (const troupe::error& e) {
      for (const char* n : b.names) CHECK_THAT(e.what(), Catch::Contains(n));
      std::printf("faults: troupe train's engine with parallel.ep 2 and %s -> refused: %s\n",
                  b.what, e.what());
    }
  }
}

TEST_CASE("MoE step time under expert parallelism at ep 1 2 and 4 with the all to all share",
          "[.ep_bench]") {
  // A benchmark, not a test (hidden): one MoE of 8 experts at the same tokens per step on 1, 2 and
  // 4 ranks (threads: dp = ep), the median step after the first and rank 0's share of it spent in
  // the MoE layers' all-to-alls (waiting for peers included). Results: docs/performance.md.
  hf::moe_config m = std::get<hf::moe_config>(tiny_moe());
  m.vocab_size = 512;
  m.hidden_size = 256;
  m.intermediate_size = 512;
  m.num_hidden_layers = 2;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 4;
  m.num_experts = 8;
  train_config c = tiny_run();
  c.batch = 8;
  c.seq = 64;
  c.steps = 6;
  const auto rows = [](std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& out) {
    out.resize(static_cast<std::size_t>(batch) * seq);
    for (std::size_t i = 0; i < out.size(); ++i)
      out[i] = static_cast<std::int32_t>((draw * 7919 + i * i * 31 + i * 17) % 512);
  };
  for (int ep : {1, 2, 4}) {
    c.plan.dp = ep;
    c.plan.ep = ep;
    auto dp = collective::make_local_group(ep);
    auto same = collective::make_local_group(ep);
    std::vector<std::unique_ptr<collective::communicator>> solo;
    for (int i = 0; i < ep; ++i) solo.push_back(std::move(collective::make_local_group(1)[0]));
    std::vector<collective::communicator*> all;
    for (auto* g : {&dp, &same, &solo})
      for (auto& x : *g) all.push_back(x.get());
    std::vector<double> step(c.steps), share(c.steps);
    testing::run_threads(
        ep,
        [&](int d) {
          ep_trainer t(hf::model_config(m), c, {dp[d].get(), same[d].get(), solo[d].get()});
          t.model().init_weights(1);
          for (int s = 0; s < c.steps; ++s) {
            const auto r = t.step(rows);
            if (d == 0) {
              step[s] = r.seconds;
              share[s] = t.last_load().exchange_seconds / r.seconds;
            }
          }
        },
        all);
    std::vector<double> st(step.begin() + 1, step.end()), sh(share.begin() + 1, share.end());
    std::sort(st.begin(), st.end());
    std::sort(sh.begin(), sh.end());
    std::printf("ep %d: %lld tokens per step, median step %.1f ms, all-to-all share %.0f%%\n", ep,
                static_cast<long long>(c.batch * c.seq), st[st.size() / 2] * 1e3,
                sh[sh.size() / 2] * 100);
  }
}
