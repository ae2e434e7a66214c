// The MoE family under pipeline plans (moe_stage.hpp): pp2 with 1F1B, interleaved, zero-bubble
// and recompute, and dp2 x pp2 (ZeRO 0 and 1), Mixtral-tiny and Qwen2-MoE-tiny, against the
// single-process trainer at the same tokens per step, with the router aux loss in the loss.
//
// The aux loss is per forward over its rows (n_expert * sum_e f_e P_e is not linear in the rows),
// so the single process is run with train.batch one microbatch's rows and train.grad_accum the
// plan's dp x microbatches: then microbatch k of a step is the single process's micro-batch k
// (scheduler/microbatch.hpp), both compute each aux loss over the same rows, and the plan must
// equal the single process up to f32 summation order (tests/rounding.hpp, exact_run.hpp: losses
// and gradient norms per step within trajectory_k, final weights within default_k of the single
// process's own error against the same run in f64). A stage that counts only its own layers in the
// aux loss, or a backward that reads another microbatch's routing, is off by far more (the aux
// term is ~0.02 of the loss and reaches every router's gradient).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/testing.hpp"
#include "models/moe.hpp"
#include "models/parallel/exact_run.hpp"
#include "models/parallel/hybrid.hpp"
#include "models/parallel/plan_threads.hpp"
#include "models/parallel/testing.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
using troupe::models::hf::testing::temp_dir;
using troupe::models::testing::check_run_as_accurate;
using troupe::models::testing::exact_run;
using troupe::models::testing::exact_training;
using troupe::models::testing::rank_communicators;
using troupe::models::testing::run_plan;
using troupe::models::testing::run_rank_threads;
using troupe::models::testing::synthetic_rows;

namespace {

hf::model_config mixtral() {
  return named_model_config("mixtral-tiny", 29).value();  // aux loss on, coefficient 0.01
}

// Qwen2-MoE: a shared expert with its sigmoid gate, q/k/v biases, unnormalised top-k weights.
hf::model_config qwen2_moe() {
  hf::moe_config q = std::get<hf::moe_config>(mixtral());
  q.model_type = "qwen2_moe";
  q.moe_intermediate_size = 96;
  q.shared_expert_intermediate_size = 160;
  q.norm_topk_prob = false;
  return hf::model_config(q);
}

// One row per microbatch; `slots` = dp x microbatches micro-batches per step.
train_config tiny_run(int slots) {
  train_config c;
  c.steps = 4;
  c.batch = 1;
  c.grad_accum = slots;
  c.seq = 8;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.5;
  c.eps = 1e-6;  // as data_parallel.test.cpp: keeps Adam's amplified rounding noise small
  c.seed = 5;
  return c;
}

struct run_result {
  std::vector<step_result> steps;
  std::vector<float> params;  // the single process's flat layout
};

std::vector<float> host_params(causal_lm& m) {
  const tensor& p = m.memory().params();
  return {p.data_as<float>(), p.data_as<float>() + p.numel()};
}

struct reference {
  run_result f32;
  exact_run exact;
};

// The single-process f32 run of `rows` and its f64 twin. `prepare` changes the weights after
// init_weights(seed); with `start` (a folder) the starting weights are saved there for the plans.
reference single_process(const hf::model_config& model, const train_config& c,
                         const trainer::batch_source& rows = synthetic_rows,
                         const std::function<void(causal_lm&)>& prepare = {},
                         const std::string& start = {}) {
  reference r;
  auto m = make_causal_lm(model, {c.batch, c.seq});
  m->init_weights(c.seed);
  if (prepare) prepare(*m);
  auto m64 = make_causal_lm(model, {c.batch, c.seq}, dtype::f64);
  ops::copy(m->memory().params(), m64->memory().params());  // same slots, same layout
  trainer t(*m, c);
  if (!start.empty()) t.save(start, model).value();
  for (int s = 0; s < c.steps; ++s) r.f32.steps.push_back(t.step(rows));
  r.f32.params = host_params(*m);
  r.exact = exact_training(*m64, c, rows);
  return r;
}

// run_plan (plan_threads.hpp) with expert parallelism over pipeline stages, the groups carved out
// of each rank's dp group as actors/training.cpp does: ep, the ep consecutive dp ranks from
// d / ep * ep; edp, the dp ranks with the same d % ep (ids beside the grid's).
void run_ep_plan(const scheduler::parallel_plan& plan,
                 const std::function<void(int, const hybrid_groups&)>& fn) {
  if (plan.ep == 1) return run_plan(plan, fn);
  const int n = plan.world_size(), ep = plan.ep;
  auto world = std::make_shared<collective::local_world>(n);
  collective::rank_grid grid({{"dp", plan.dp}, {"pp", plan.pp}, {"tp", plan.tp}});
  rank_communicators comms(n);
  for (int r = 0; r < n; ++r) {
    for (const auto& axes :
         std::vector<std::vector<std::string>>{{"dp"}, {"pp"}, {"tp"}, {"pp", "tp"}})
      comms[r].push_back(
          collective::make_communicator(world->transport(r), grid.group(r, axes), "local", world));
    const collective::rank_group dp = grid.group(r, {"dp"});
    const int d = grid.coord(r, "dp"), size = static_cast<int>(dp.ranks.size());
    const std::uint32_t base = (1u << 23) | (1u << 22) | (dp.id * 64u);
    collective::rank_group eg{base + static_cast<std::uint32_t>(d / ep), {}};
    for (int i = d / ep * ep; i < d / ep * ep + ep; ++i) eg.ranks.push_back(dp.ranks[i]);
    collective::rank_group edp{(1u << 21) | (base + 32u + static_cast<std::uint32_t>(d % ep)), {}};
    for (int i = d % ep; i < size; i += ep) edp.ranks.push_back(dp.ranks[i]);
    comms[r].push_back(collective::make_communicator(world->transport(r), eg, "local", world));
    comms[r].push_back(collective::make_communicator(world->transport(r), edp, "local", world));
  }
  run_rank_threads(
      comms,
      [](std::vector<std::unique_ptr<collective::communicator>>& c) {
        hybrid_groups g{c[0].get(), c[1].get(), c[2].get(), c[3].get()};
        g.ep = c[4].get();
        g.edp = c[5].get();
        return g;
      },
      fn);
}

// `c` under `plan` on threads; rank 0's steps and the saved weights in the single process's layout.
// Every rank reports the same losses.
run_result planned(const hf::model_config& model, train_config c,
                   const scheduler::parallel_plan& plan, std::string* described = nullptr,
                   const trainer::batch_source& rows = synthetic_rows) {
  c.plan = plan;
  temp_dir tmp;
  std::vector<std::vector<step_result>> got(plan.world_size());
  std::vector<std::string> what(plan.world_size());
  run_ep_plan(plan, [&](int r, const hybrid_groups& g) {
    hybrid_trainer t(model, c, g);
    what[r] = t.describe();
    for (int s = 0; s < c.steps; ++s) got[r].push_back(t.step(rows));
    t.save(tmp.path());
  });
  for (int r = 1; r < plan.world_size(); ++r)
    for (int s = 0; s < c.steps; ++s) CHECK(got[r][s].loss == got[0][s].loss);
  if (described != nullptr) *described = what[0];
  auto whole = make_causal_lm(model, {c.batch, c.seq});
  hf::load_weights(tmp.path(), model, whole->slots()).value();
  return {got[0], host_params(*whole)};
}

scheduler::parallel_plan pipeline(int dp, int microbatches) {
  scheduler::parallel_plan p;
  p.dp = dp;
  p.pp = 2;
  p.microbatches = microbatches;
  return p;
}

}  // namespace

TEST_CASE("MoE pipeline stages train like the single process with the router aux loss",
          "[parallel][moe]") {
  struct row {
    std::string name;
    scheduler::parallel_plan plan;
    bool qwen_too;
  };
  auto interleaved = pipeline(1, 4);
  interleaved.schedule = scheduler::schedule_kind::interleaved;
  interleaved.virtual_stages = 2;  // 4 virtual stages of one layer each
  auto zero_bubble = pipeline(1, 4);
  zero_bubble.schedule = scheduler::schedule_kind::zero_bubble;
  auto recompute = pipeline(1, 4);
  recompute.recompute = scheduler::recompute_policy::full;
  auto zero1 = pipeline(2, 2);
  zero1.zero = 1;
  const std::vector<row> rows = {
      {"pp2 1F1B", pipeline(1, 4), true},      {"pp2 interleaved", interleaved, true},
      {"pp2 zero bubble", zero_bubble, false}, {"pp2 recompute full", recompute, false},
      {"dp2 x pp2", pipeline(2, 2), true},     {"dp2 x pp2 ZeRO 1", zero1, false}};
  for (bool qwen : {false, true}) {
    const auto model = qwen ? qwen2_moe() : mixtral();
    const train_config c = tiny_run(4);
    const auto ref = single_process(model, c);
    for (const auto& [name, plan, qwen_too] : rows) {
      if (qwen && !qwen_too) continue;
      INFO((qwen ? "qwen2-moe " : "mixtral ") << name);
      std::string described;
      const auto got = planned(model, c, plan, &described);
      INFO("rank 0: " << described);
      CHECK(described.find("stage 0 of 2") != std::string::npos);
      check_run_as_accurate(got, ref.f32, ref.exact);
    }
  }
}

// dp2 x ep2 x pp2 (4 ranks): each stage's MoE layers split over its two dp ranks (experts 0-1 on
// dp rank 0, 2-3 on dp rank 1), rows exchanged over the stage's ep group in every microbatch's
// forward and backward, the expert gradients complete on their holder (not reduced), the rest
// reduced over dp. dp4 x ep2 x pp2 (8 ranks): two ep groups per stage, each expert on two dp ranks
// and its gradient reduced over those (the edp group). dp2 x ep2 x pp2 also with zero bubble (the
// experts' weight passes after the exchanges) and full recompute (the exchange run again before
// each backward). The same tokens per step and the same rule as above.
TEST_CASE("Expert parallel pipeline stages train like the single process", "[parallel][moe]") {
  auto interleaved = pipeline(2, 2);
  interleaved.schedule = scheduler::schedule_kind::interleaved;
  interleaved.virtual_stages = 2;
  auto zero_bubble = pipeline(2, 2);
  zero_bubble.schedule = scheduler::schedule_kind::zero_bubble;
  auto recompute = pipeline(2, 2);
  recompute.recompute = scheduler::recompute_policy::full;
  for (bool qwen : {false, true})
    for (auto plan : {pipeline(2, 2), interleaved, pipeline(4, 2), zero_bubble, recompute}) {
      if (qwen && plan.virtual_stages > 1) continue;
      plan.ep = 2;
      const auto model = qwen ? qwen2_moe() : mixtral();
      const train_config c = tiny_run(plan.dp * plan.microbatches);
      const auto ref = single_process(model, c);
      INFO((qwen ? "qwen2-moe " : "mixtral ") << scheduler::describe(plan));
      std::string described;
      const auto got = planned(model, c, plan, &described);
      INFO("rank 0: " << described);
      CHECK(described.find("experts 0-1 of 4 of every MoE layer (ep 0 of 2, expert data "
                           "parallel 0 of " +
                           std::to_string(plan.dp / 2) + ")") != std::string::npos);
      check_run_as_accurate(got, ref.f32, ref.exact);
    }
}

namespace {

// Weights under which the router's choice depends on the sign of a token's embedding in channel
// 0 alone (as expert_parallel.test.cpp's): embed_tokens[t, 0] = +3 for t < 15, -3 else; no
// attention or expert output writes channel 0 (o_proj and every down_proj row 0 zero), so it stays
// the embedding's in every layer; each router's column 0 is (1, -1, 0.5, -0.5), which dominates its
// logits: tokens t < 15 choose experts 0 and 2, the others 1 and 3, in every layer of both stages.
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

// Rows of tokens below 15 for the draws `low` says, of tokens 15..28 for the others.
trainer::batch_source split_rows(std::function<bool(std::uint64_t draw)> low) {
  return [low](std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
    rows.resize(static_cast<std::size_t>(batch) * seq);
    for (int b = 0; b < batch; ++b)
      for (int i = 0; i < seq; ++i) {
        const auto v = static_cast<std::int32_t>((draw * 7 + b * 5 + i * i * 3 + i) % 14);
        rows[static_cast<std::size_t>(b) * seq + i] = low(draw) ? v : 15 + v;
      }
  };
}

// The top-k choices of each expert (over the layers) of model `model` with weights `params` on
// the draws [first, end) of `rows` that `pick` selects, one forward per draw.
std::vector<std::int64_t> chosen(const hf::model_config& model, const std::vector<float>& params,
                                 const trainer::batch_source& rows, int seq, std::uint64_t end,
                                 const std::function<bool(std::uint64_t)>& pick) {
  auto lm = make_causal_lm(model, {1, seq});
  auto* m = dynamic_cast<causal_lm_of<moe>*>(lm.get());
  REQUIRE(m != nullptr);
  REQUIRE(m->memory().params().numel() == static_cast<std::int64_t>(params.size()));
  std::copy(params.begin(), params.end(), m->memory().params().data_as<float>());
  std::vector<std::int64_t> out;
  std::vector<std::int32_t> ids, tg;
  for (std::uint64_t d = 0; d < end; ++d) {
    if (!pick(d)) continue;
    rows(d, 1, seq, ids);
    tg = ids;
    m->forward(tensor(ids.data(), ids.size() * 4, dtype::i32, {1, seq}),
               tensor(tg.data(), tg.size() * 4, dtype::i32, {1, seq}));
    const auto sel = m->model().load().selected;
    out.resize(sel.size(), 0);
    for (std::size_t e = 0; e < sel.size(); ++e) out[e] += sel[e];
  }
  return out;
}

}  // namespace

// Starvation under ep x pp: with the split routing, dp rank 0 reads only even draws (tokens < 15:
// experts 0 and 2) and dp rank 1 only odd ones (experts 1 and 3), so on each stage expert 1 (held
// by dp rank 0) is fed only by the other replica's tokens and expert 2 (dp rank 1) only by rank
// 0's; with every draw low, experts 1 and 3 get no token of the job in any layer, and their
// holders step on zero gradients. Neither hangs, and both train like the single process.
TEST_CASE("Expert parallel pipeline stages train experts no token of a replica or of the job chose",
          "[parallel][moe]") {
  auto plan = pipeline(2, 2);
  plan.ep = 2;
  const auto model = mixtral();
  const train_config c = tiny_run(4);
  for (bool whole_job : {false, true}) {
    INFO((whole_job ? "starved by the whole job" : "fed by one replica"));
    const auto rows = split_rows([whole_job](std::uint64_t draw) {
      return whole_job || draw % 2 == 0;  // slot q of a step is draw 4 s + q, dp rank q % 2
    });
    temp_dir tmp;
    const auto ref = single_process(model, c, rows, split_routing, tmp.path().string());
    // The routing the weights were made for, with the starting and the trained weights, over
    // every draw of the run: dp rank 0's draws never choose expert 1 (held by dp rank 0: fed only
    // by rank 1's rows), rank 1's never expert 0; with every draw low expert 1 gets no token.
    const auto end = static_cast<std::uint64_t>(c.steps * c.grad_accum);
    auto start = make_causal_lm(model, {1, c.seq});
    hf::load_weights(tmp.path(), model, start->slots()).value();
    for (const auto& w : {host_params(*start), ref.f32.params}) {
      const auto even = chosen(model, w, rows, c.seq, end, [](auto d) { return d % 2 == 0; });
      const auto odd = chosen(model, w, rows, c.seq, end, [](auto d) { return d % 2 == 1; });
      CHECK(even[1] == 0);
      CHECK(even[0] > 0);
      CHECK((whole_job ? odd[1] == 0 : odd[0] == 0));
    }
    train_config pc = c;
    pc.model_hf = tmp.path().string();
    const auto got = planned(model, pc, plan, nullptr, rows);
    check_run_as_accurate(got, ref.f32, ref.exact);
  }
}

TEST_CASE("Expert parallel pipeline plans it cannot run are refused naming the setting",
          "[parallel][moe][faults]") {
  struct bad {
    const char* what;
    int dp;
    int zero;
    const char* precision;
    const char* names;
  };
  for (const auto& b : std::vector<bad>{{"ZeRO 2", 4, 2, "f32", "parallel.zero 0 (got 2)"},
                                        {"ZeRO 1", 2, 1, "f32", "parallel.zero 0 (got 1)"},
                                        {"bf16", 2, 0, "bf16", "train.precision f32 (got bf16)"}}) {
    INFO(b.what);
    auto plan = pipeline(b.dp, 2);
    plan.ep = 2;
    plan.zero = b.zero;
    train_config c = tiny_run(2 * b.dp);
    c.precision = b.precision;
    c.plan = plan;
    try {
      run_ep_plan(plan, [&](int, const hybrid_groups& g) { hybrid_trainer t(mixtral(), c, g); });
      FAIL("accepted");
    } catch (const troupe::error& e) {
      const std::string message = e.what();
      CHECK(message.find("parallel.ep (--ep) 2 with parallel.pp (--pp) 2") != std::string::npos);
      CHECK(message.find(b.names) != std::string::npos);
      std::printf("faults: MoE dp%d x ep2 x pp2 with %s -> refused: %s\n", b.dp, b.what, e.what());
    }
  }
}

// ---- bf16 and f16 ----------------------------------------------------------------------------

namespace {

// The single process computing in `half` (bf16 or f16, f32 master weights) with its checkpoint in
// `dir`, and the exact (f64) twin from the same `half`-rounded starting weights (as
// mixed_plans.test.cpp's rows).
struct half_reference {
  std::vector<step_result> steps;
  exact_run exact;
};

half_reference single_half(const hf::model_config& model, const train_config& c, dtype half,
                           const std::string& dir) {
  half_reference r;
  auto m = make_causal_lm(model, {c.batch, c.seq}, half);
  m->init_weights(c.seed);
  auto m64 = make_causal_lm(model, {c.batch, c.seq}, dtype::f64);
  ops::copy(m->memory().params(), m64->memory().params());  // same slots, same layout
  trainer t(*m, c);
  for (int s = 0; s < c.steps; ++s) r.steps.push_back(t.step(synthetic_rows));
  t.save(dir, model).value();
  r.exact = exact_training(*m64, c, synthetic_rows);
  return r;
}

// The f32 master weights of a checkpoint in the single process's flat layout.
std::vector<float> saved_params(const hf::model_config& model, const train_config& c,
                                const std::string& dir) {
  auto whole = make_causal_lm(model, {c.batch, c.seq});
  hf::load_weights(dir, model, whole->slots()).value();
  return host_params(*whole);
}

// Mixtral-tiny with the aux loss's coefficient 0.5 instead of 0.01: at 0.01 the aux term is ~0.02
// of the loss and its gradient below what bf16 rounding of 4 steps shows (dropping it altogether
// was measured at 3.7 times the single process's error, inside default_k); at 0.5 a lost or
// mis-scaled aux gradient is far outside it.
hf::model_config loud_aux() {
  hf::moe_config m = std::get<hf::moe_config>(mixtral());
  m.router_aux_loss_coef = 0.5;
  return hf::model_config(m);
}

}  // namespace

// bf16 (and f16 with its loss scale) MoE pipeline stages: the boundary is a bf16 / f16 tensor whose
// extra sample carries the router statistics as f64 bytes (moe_stage.hpp), and under f16 the
// microbatch weight in the backward's extra sample includes the loss scale. The rule is
// mixed_plans.test.cpp's bf16 rows': both 16-bit runs (the plan's, the single process's at the same
// tokens per step) are judged against the f64 twin from the same rounded starting weights, each
// step's loss and gradient norm within tests::default_k of the single process's own error (every
// activation is rounded to 8 (bf16) or 11 (f16) bits in both runs: their errors are of one size),
// the master weights all together within default_k. Statistics garbled by the 16-bit boundary (a
// cast, or bytes read as numbers) or an aux gradient off by the loss scale moves every router by
// O(1) of its gradient, far beyond a 16-bit rounding of it. The f16 runs start at a loss scale
// their gradients fit (1024), so no step is skipped and the f64 twin steps every step.
TEST_CASE("MoE pipeline stages in bf16 and f16 train as accurately as the single process",
          "[parallel][moe]") {
  auto interleaved = pipeline(1, 4);
  interleaved.schedule = scheduler::schedule_kind::interleaved;
  interleaved.virtual_stages = 2;
  auto zero_bubble = pipeline(1, 4);
  zero_bubble.schedule = scheduler::schedule_kind::zero_bubble;
  for (const char* precision : {"bf16", "f16"}) {
    train_config c = tiny_run(4);
    c.precision = precision;
    c.loss_scale = 1024;
    const dtype half = c.precision == "f16" ? dtype::f16 : dtype::bf16;
    temp_dir tmp;
    const std::string ref_dir = (tmp / "single").string();
    const auto model = loud_aux();
    const auto ref = single_half(model, c, half, ref_dir);
    const auto ref_params = saved_params(model, c, ref_dir);
    for (const auto& plan : {pipeline(1, 4), interleaved, zero_bubble, pipeline(2, 2)}) {
      INFO(precision << " mixtral " << scheduler::describe(plan));
      const auto got = planned(model, c, plan);
      std::vector<double> gl, rl, gn, rn;
      for (int s = 0; s < c.steps; ++s) {
        CHECK_FALSE(got.steps[s].skipped);
        CHECK_FALSE(ref.steps[s].skipped);
        gl.push_back(got.steps[s].loss);
        rl.push_back(ref.steps[s].loss);
        gn.push_back(got.steps[s].grad_norm);
        rn.push_back(ref.steps[s].grad_norm);
      }
      const auto losses = tests::as_accurate_as(gl, rl, ref.exact.loss, tests::default_k);
      const auto norms = tests::as_accurate_as(gn, rn, ref.exact.grad_norm, tests::default_k);
      const auto weights = tests::as_accurate_as(got.params, ref_params, ref.exact.params);
      INFO("losses: " << losses.str());
      INFO("gradient norms: " << norms.str());
      INFO("master weights: " << weights.str());
      CHECK(losses.ok());
      CHECK(norms.ok());
      CHECK(weights.ok());
      if (std::getenv("TROUPE_ROUNDING_REPORT") != nullptr)
        std::printf("%s MoE %s ratios: losses %.3g, norms %.3g, weights %.3g\n", precision,
                    scheduler::describe(plan).c_str(), losses.ratio(), norms.ratio(),
                    weights.ratio());
    }
  }
}

// hybrid_trainer::gather_parameters (what an RL trainer under a plan sends its rollout actors)
// under dp2 x ep2 x pp2: each dp rank holds half of every stage's experts, so the whole model is
// summed over dp as well as over the stages, as save() does. The gathered f32 parameters are the
// saved checkpoint's bit for bit (both copy the same master weights; the sums add zeros).
TEST_CASE("An expert parallel pipeline gathers the parameters it saves", "[parallel][moe]") {
  auto plan = pipeline(2, 2);
  plan.ep = 2;
  const auto model = mixtral();
  train_config c = tiny_run(4);
  c.steps = 2;
  c.plan = plan;
  const std::int64_t numel = make_causal_lm(model, {c.batch, c.seq})->memory().params().numel();
  temp_dir tmp;
  std::vector<std::vector<float>> got(plan.world_size(),
                                      std::vector<float>(static_cast<std::size_t>(numel), -1.0f));
  std::vector<int> wrote(plan.world_size(), 0);
  run_ep_plan(plan, [&](int r, const hybrid_groups& g) {
    hybrid_trainer t(model, c, g);
    for (int s = 0; s < c.steps; ++s) t.step(synthetic_rows);
    auto& to = got[static_cast<std::size_t>(r)];
    wrote[r] = t.gather_parameters(tensor(to.data(), to.size() * 4, dtype::f32, {numel})) ? 1 : 0;
    t.save(tmp.path());
  });
  const auto saved = saved_params(model, c, tmp.path().string());
  REQUIRE(std::count(wrote.begin(), wrote.end(), 1) == 1);
  const auto& gathered =
      got[static_cast<std::size_t>(std::find(wrote.begin(), wrote.end(), 1) - wrote.begin())];
  std::size_t differ = 0;
  for (std::size_t i = 0; i < saved.size(); ++i) differ += gathered[i] != saved[i] ? 1 : 0;
  CHECK(differ == 0);
}

// Checkpoints of dp2 x ep2 x pp2 (each dp rank writes its own experts' weights and moments) after 2
// of 4 steps resume in the single process and under dp2 x ep2 x pp2, and the last 2 steps and the
// final weights are the uninterrupted single process's by the f32 rule above. A checkpoint missing
// an expert's moments (or resumed into the wrong experts) restarts AdamW there: off by ~lr.
TEST_CASE("Expert parallel pipeline checkpoints resume in one process and under the plan",
          "[parallel][moe]") {
  auto plan = pipeline(2, 2);
  plan.ep = 2;
  const auto model = mixtral();
  const train_config c = tiny_run(4);
  const auto ref = single_process(model, c);
  temp_dir tmp;
  const std::string half = (tmp / "half").string();
  train_config pc = c;
  pc.plan = plan;
  run_ep_plan(plan, [&](int, const hybrid_groups& g) {
    hybrid_trainer t(model, pc, g);
    for (int s = 0; s < 2; ++s) t.step(synthetic_rows);
    t.save(half);
  });
  run_result want{{ref.f32.steps.begin() + 2, ref.f32.steps.end()}, ref.f32.params};
  exact_run x = ref.exact;
  x.loss.erase(x.loss.begin(), x.loss.begin() + 2);
  x.grad_norm.erase(x.grad_norm.begin(), x.grad_norm.begin() + 2);
  SECTION("in one process") {
    auto m = make_causal_lm(model, {c.batch, c.seq});
    trainer t(*m, c);
    REQUIRE(t.resume(half, model).value() == 2);
    run_result got;
    for (int s = 2; s < c.steps; ++s) got.steps.push_back(t.step(synthetic_rows));
    got.params = host_params(*m);
    check_run_as_accurate(got, want, x);
  }
  SECTION("under dp2 x ep2 x pp2") {
    train_config rest = pc;
    rest.resume = half;
    const std::string dir = (tmp / "rest").string();
    std::vector<std::vector<step_result>> steps(plan.world_size());
    run_ep_plan(plan, [&](int r, const hybrid_groups& g) {
      hybrid_trainer t(model, rest, g);
      while (t.steps_done() < c.steps) steps[r].push_back(t.step(synthetic_rows));
      t.save(dir);
    });
    REQUIRE(steps[0].size() == 2);
    check_run_as_accurate(run_result{steps[0], saved_params(model, c, dir)}, want, x);
  }
}
