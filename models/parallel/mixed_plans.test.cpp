// bf16 under tensor shards and pipeline stages (hybrid.hpp with train.precision = "bf16"): every
// piece computes in bf16 under mixed_piece (f32 master weights, gradients and moments in the
// data-parallel engine), and tp2 + SP, pp2 and dp2 x pp2 x tp2 train as accurately as the
// single-process bf16 trainer at the same tokens per step, GPT-2 and Llama; their checkpoints hold
// the f32 master weights and resume under another plan.
//
// The tolerance rule (tests/rounding.hpp, as for the f32 plans): both bf16 runs - the plan's and
// the single process's - are judged against the exact-arithmetic (f64) twin of the single process
// from the same bf16-rounded starting weights, and the plan's error must be within k times the
// single process's own error: trajectory_k for each step's loss and gradient norm, default_k for
// every parameter's final master weights (each by its own scale). bf16 rounds with an 8-bit
// mantissa, so both runs sit ~2^-9 relative from the exact run, 2^15 times further than f32 runs;
// a plan rounds at other points (a row-parallel layer rounds each shard's partial sum to bf16
// before the f32 allreduce rounds once more, pipeline boundaries carry bf16 activations as the
// single process's residual stream does, the tied embedding's two bf16 gradients are summed
// across stages), a few roundings more of the same size, so the ratio stays O(1). A wrong plan (a
// reduction dropped, a microbatch lost) is off by O(1) in the loss or gradient: far beyond k times
// bf16's rounding (the last test shows it is caught).
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/families.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/testing.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/exact_run.hpp"
#include "models/parallel/hybrid.hpp"
#include "models/parallel/mixed_piece.hpp"
#include "models/parallel/model_producer.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/plan_threads.hpp"
#include "models/parallel/testing.hpp"
#include "models/targets.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
using troupe::models::hf::testing::temp_dir;
using troupe::models::testing::run_plan;

namespace {

void rows_of(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3) % 64);
}

hf::model_config model_of(bool llama) {
  return named_model_config(llama ? "llama-tiny" : "gpt2-demo", 64).value();
}

// The ratio allowed for each step's loss and gradient norm in bf16: tests::default_k, not the f32
// plans' trajectory_k (64). In f32 a step's loss differs between two runs mostly through the few
// weights AdamW moved by ~lr in one run and not the other (heavy-tailed, up to 20 measured); in
// bf16 every activation is rounded to 8 bits in both runs, and those roundings, not the few
// magnified weights, set both runs' errors, so their ratio is O(1) (measured 0.19 to 2.4 over the
// rows below). 64 would be too loose to see a wrong plan at bf16's rounding: a run of half the
// tokens per step is off by 20 times the single process's error in its losses.
constexpr double bf16_trajectory_k = tests::default_k;

train_config bf16_run() {
  train_config c;
  c.steps = 6;
  c.batch = 4;
  c.seq = 8;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.5;  // the first steps' norms exceed it: clipping runs on the reduced gradients
  c.eps = 1e-6;  // as mixed_piece.test.cpp: keeps AdamW from magnifying rounding noise to ~lr
  c.precision = "bf16";
  c.seed = 5;
  return c;
}

scheduler::parallel_plan plan_of(int dp, int pp, int tp, bool sp = false) {
  scheduler::parallel_plan p;
  p.dp = dp;
  p.pp = pp;
  p.tp = tp;
  p.sp = sp;
  p.microbatches = pp > 1 ? 4 / dp : 1;  // one row per microbatch under pp
  return p;
}

// The 16-bit type a run of `c` computes in (bf16 or f16).
dtype half_of(const train_config& c) {
  return c.precision == "f16" ? dtype::f16 : dtype::bf16;
}

// The single-process bf16 / f16 trainer (f32 master weights): steps [0, steps), saved into `dir`.
std::vector<step_result> single(bool llama, const train_config& c, const std::string& dir) {
  const auto model = model_of(llama);
  auto m = make_causal_lm(model, {c.batch, c.seq}, half_of(c));
  m->init_weights(c.seed);
  trainer t(*m, c);
  std::vector<step_result> out;
  for (int s = 0; s < c.steps; ++s) out.push_back(t.step(rows_of));
  t.save(dir, model).value();
  return out;
}

// The exact-arithmetic twin of the bf16 runs: the trainer in f64 from the same bf16-rounded
// weights (the master weights of both bf16 runs start there).
struct exact_twin {
  testing::exact_run run;
  std::unique_ptr<causal_lm> model;
};

exact_twin exact_single(bool llama, const train_config& c) {
  auto start = make_causal_lm(model_of(llama), {c.batch, c.seq}, dtype::bf16);
  start->init_weights(c.seed);
  exact_twin x;
  x.model = make_causal_lm(model_of(llama), {c.batch, c.seq}, dtype::f64);
  ops::copy(start->memory().params(), x.model->memory().params());  // same slots, same layout
  x.run = testing::exact_training(*x.model, c, rows_of);
  return x;
}

struct plan_result {
  std::vector<step_result> steps;  // rank 0's
  std::string described;           // rank 0's piece
};

// `c` under `plan` from step `from` (c.resume) or 0 to c.steps, saved into `dir` at the end. Every
// rank reports the same losses.
plan_result planned(bool llama, train_config c, const scheduler::parallel_plan& plan,
                    const std::string& dir) {
  c.plan = plan;
  const auto model = model_of(llama);
  std::vector<plan_result> got(plan.world_size());
  run_plan(plan, [&](int r, const hybrid_groups& g) {
    hybrid_trainer t(model, c, g);
    got[r].described = t.describe();
    while (t.steps_done() < c.steps) got[r].steps.push_back(t.step(rows_of));
    t.save(dir);
  });
  for (int r = 1; r < plan.world_size(); ++r)
    for (std::size_t s = 0; s < got[0].steps.size(); ++s) {
      CHECK(got[r].steps[s].loss == got[0].steps[s].loss);
      CHECK(got[r].steps[s].skipped == got[0].steps[s].skipped);  // f16: one decision
      CHECK(got[r].steps[s].loss_scale == got[0].steps[s].loss_scale);
    }
  return got[0];
}

// The master weights in checkpoints `got` and `ref` (f32, HF layout): `got`'s as accurate as
// `ref`'s against the exact twin's, all parameters together as one quantity (as
// mixed_piece.test.cpp judges the dp rows). Not parameter by parameter as the f32 plans are: with
// bf16 gradients AdamW moves a weight whose gradient is below bf16's rounding of its terms by ~lr
// in a random direction in every run, so a small parameter's error is lr-sized or not by chance
// (measured: GPT-2's h.1.attn.o_proj.bias at 0.0029 under every plan, 0.00026 in the single
// process, ratio 11), while over the whole model both runs have such weights and their largest
// errors agree.
void check_weights(bool llama, const std::string& got, const std::string& ref,
                   const exact_twin& x) {
  const auto model = model_of(llama);
  auto mg = make_whole_model(model, 8), mr = make_whole_model(model, 8);
  hf::load_weights(got, model, mg->slots()).value();
  hf::load_weights(ref, model, mr->slots()).value();
  std::vector<double> g, r, e;
  for (const auto& s : x.model->slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    const tensor_slot* sg = testing::param_slot(mg->slots(), s.name);
    const tensor_slot* sr = testing::param_slot(mr->slots(), s.name);
    REQUIRE(sg != nullptr);
    REQUIRE(sr != nullptr);
    for (auto [to, from] : {std::pair{&g, sg}, std::pair{&r, sr}, std::pair{&e, &s}}) {
      const auto v = testing::as_f64(*from->field);
      to->insert(to->end(), v.begin(), v.end());
    }
  }
  const auto v = tests::as_accurate_as(g, r, e);
  INFO("master weights: " << v.str());
  CHECK(v.ok());
  if (std::getenv("TROUPE_ROUNDING_REPORT") != nullptr)
    std::printf("master weights ratio %.3g\n", v.ratio());
}

// Each step's loss and gradient norm of `got` as accurate as `ref`'s against the exact run's,
// within bf16_trajectory_k.
struct trajectory_verdicts {
  tests::rounding_verdict losses, norms;
};

trajectory_verdicts judge_steps(const std::vector<step_result>& got,
                                const std::vector<step_result>& ref, const testing::exact_run& x) {
  std::vector<double> gl, rl, gn, rn;
  for (std::size_t s = 0; s < x.loss.size(); ++s) {
    gl.push_back(got.at(s).loss);
    rl.push_back(ref.at(s).loss);
    gn.push_back(got.at(s).grad_norm);
    rn.push_back(ref.at(s).grad_norm);
  }
  return {tests::as_accurate_as(gl, rl, x.loss, bf16_trajectory_k),
          tests::as_accurate_as(gn, rn, x.grad_norm, bf16_trajectory_k)};
}

void check_steps(const std::vector<step_result>& got, const std::vector<step_result>& ref,
                 const testing::exact_run& x) {
  const auto v = judge_steps(got, ref, x);
  INFO("losses: " << v.losses.str());
  INFO("gradient norms: " << v.norms.str());
  CHECK(v.losses.ok());
  CHECK(v.norms.ok());
  if (std::getenv("TROUPE_ROUNDING_REPORT") != nullptr)
    std::printf("bf16 ratios: losses %.3g, norms %.3g\n", v.losses.ratio(), v.norms.ratio());
}

// ---- f16 -----------------------------------------------------------------------------------
//
// f16 (mixed_piece.hpp, loss_scaler.hpp): the same pieces in f16 with the engine's dynamic loss
// scaling. The runs start at a loss scale above what the tiny models' gradients fit in f16, so the
// first steps overflow and halve it until they fit, and the scale doubles after every 2 good steps,
// so it comes back to the edge and overflows again: the rows compare a scale sequence with skips
// and growth, not a constant scale (GPT-2 and Llama follow different sequences, f16_run). The
// overflow decisions must be the single process's at every step. They agree for a reason, not by
// luck: every token's loss is scaled as in the single process (mixed_piece.hpp), so the per-token
// gradients are as large as there and each rank's accumulated f16 gradients are parts of the single
// process's sums (measured before that: scaling each rank's own mean loss instead, dp2's ranks
// overflowed at a scale the single process fitted). A part can exceed its whole only through
// cancellation between the parts, and only a step whose largest value lies near f16's maximum
// could then go either way; on none of these steps does that happen.

// The learning rate is constant (lr = min_lr, no warmup), so the exact twin skips the steps the
// f16 runs skip by not stepping: the schedule's position does not matter then.
train_config f16_run() {
  train_config c = bf16_run();
  c.precision = "f16";
  c.steps = 8;
  c.lr = c.min_lr = 2e-3;
  c.warmup = 0;
  // GPT-2: 2^19! 2^18! 2^17 2^17 2^18 2^18 2^19! 2^18; Llama: 2^19! 2^18! 2^17 2^17 2^18! 2^17
  // 2^17! 2^16 ("!": skipped).
  c.loss_scale = 1 << 19;
  c.loss_scale_growth = 2;
  return c;
}

// The exact twin of f16 runs that skipped the steps `ref` skipped: the f64 trainer from the same
// f16-rounded weights, stepping where they stepped. A skipped step's loss is the forward of its
// batch (what the f16 runs report as well), its gradient norm 0.
exact_twin exact_f16(bool llama, const train_config& c, const std::vector<step_result>& ref) {
  const auto model = model_of(llama);
  auto start = make_causal_lm(model, {c.batch, c.seq}, dtype::f16);
  start->init_weights(c.seed);
  exact_twin x;
  x.model = make_causal_lm(model, {c.batch, c.seq}, dtype::f64);
  ops::copy(start->memory().params(), x.model->memory().params());  // same slots, same layout
  train_config e = c;
  e.precision = "f64";
  trainer t(*x.model, e);
  const int b = static_cast<int>(c.batch), t_len = static_cast<int>(c.seq);
  std::vector<std::int32_t> rows, targets;
  for (int s = 0; s < c.steps; ++s) {
    if (ref.at(static_cast<std::size_t>(s)).skipped) {
      x.run.loss.push_back(evaluate(*x.model, rows_of, b, t_len, static_cast<std::uint64_t>(s), 1));
      x.run.grad_norm.push_back(0.0);
      continue;
    }
    // Draw s: the step's own batch (the trainer's count of steps lags by the skipped ones).
    const auto r = t.step([&](causal_lm& m, std::uint64_t, double scale) {
      rows_of(static_cast<std::uint64_t>(s), b, t_len, rows);
      targets.resize(rows.size());
      tensor ids(rows.data(), rows.size() * 4, dtype::i32, {b, t_len});
      tensor tg(targets.data(), targets.size() * 4, dtype::i32, {b, t_len});
      next_token_targets(ids, tg);
      const double loss = m.forward(ids, tg);
      m.backward(scale);
      return loss;
    });
    x.run.loss.push_back(r.loss);
    x.run.grad_norm.push_back(r.grad_norm);
  }
  return x;
}

// The steps' skip decisions and loss scales of `got` are `ref`'s, step by step.
void check_scales(const std::vector<step_result>& got, const std::vector<step_result>& ref) {
  REQUIRE(got.size() == ref.size());
  for (std::size_t s = 0; s < ref.size(); ++s) {
    INFO("step " << s << ": scale " << got[s].loss_scale << " vs " << ref[s].loss_scale);
    CHECK(got[s].skipped == ref[s].skipped);
    CHECK(got[s].loss_scale == ref[s].loss_scale);
    if (got[s].skipped) CHECK(got[s].grad_norm == 0.0);  // no norm, no clipping, no update
  }
}

// f16 has an 11-bit mantissa: both f16 runs sit ~2^-12 relative from the exact run, 8 times
// closer than bf16's, and the plan rounds at the same few extra points the bf16 rows list, so the
// ratio of the two runs' errors is O(1) as there: the bf16 rows' k (default_k) for the losses (all
// steps, skipped ones included: their forward) and the gradient norms (the steps that updated).
void check_f16_steps(const std::vector<step_result>& got, const std::vector<step_result>& ref,
                     const testing::exact_run& x) {
  std::vector<step_result> g, r;
  testing::exact_run stepped;
  for (std::size_t s = 0; s < x.loss.size(); ++s) {
    if (ref.at(s).skipped) continue;
    g.push_back(got.at(s));
    r.push_back(ref.at(s));
    stepped.loss.push_back(x.loss[s]);
    stepped.grad_norm.push_back(x.grad_norm[s]);
  }
  std::vector<double> gl, rl;
  for (std::size_t s = 0; s < x.loss.size(); ++s) {
    gl.push_back(got.at(s).loss);
    rl.push_back(ref.at(s).loss);
  }
  const auto losses = tests::as_accurate_as(gl, rl, x.loss, bf16_trajectory_k);
  const auto norms = judge_steps(g, r, stepped).norms;
  INFO("losses: " << losses.str());
  INFO("gradient norms: " << norms.str());
  CHECK(losses.ok());
  CHECK(norms.ok());
  if (std::getenv("TROUPE_ROUNDING_REPORT") != nullptr)
    std::printf("f16 ratios: losses %.3g, norms %.3g\n", losses.ratio(), norms.ratio());
}

std::string scale_line(const std::vector<step_result>& steps) {
  std::ostringstream out;
  for (const auto& r : steps) out << ' ' << r.loss_scale << (r.skipped ? "!" : "");
  return out.str();
}

// Steps 0..2 of GPT-2 run `c` under tp2 + SP, saved in `dir`: the schedule spans all of c's steps,
// the run stops after 3 (the checkpoint tests resume the rest elsewhere).
void save_first_steps_under_tp2(const train_config& c, const std::string& dir) {
  train_config first = c;
  first.plan = plan_of(1, 1, 2, true);
  run_plan(first.plan, [&](int, const hybrid_groups& g) {
    hybrid_trainer t(model_of(false), first, g);
    for (int s = 0; s < 3; ++s) t.step(rows_of);
    t.save(dir);
  });
}

// The same 3 steps in one process computing in `compute`, saved in `dir`.
void save_first_steps_in_one_process(const train_config& c, dtype compute, const std::string& dir) {
  const auto model = model_of(false);
  auto m = make_causal_lm(model, {c.batch, c.seq}, compute);
  m->init_weights(c.seed);
  trainer t(*m, c);
  for (int s = 0; s < 3; ++s) t.step(rows_of);
  t.save(dir, model).value();
}

}  // namespace

TEST_CASE("Tensor shards and pipeline stages in bf16 train as accurately as the single process",
          "[parallel]") {
  struct row {
    scheduler::parallel_plan plan;
    bool llama_too;  // GPT-2 always; Llama where the row is cheap
  };
  auto interleaved = plan_of(1, 2, 1);
  interleaved.schedule = scheduler::schedule_kind::interleaved;
  interleaved.virtual_stages = 2;
  auto zero_bubble = plan_of(1, 2, 1);
  zero_bubble.schedule = scheduler::schedule_kind::zero_bubble;
  auto tp_zero3 = plan_of(2, 1, 2);
  tp_zero3.zero = 3;
  auto recompute = plan_of(1, 2, 2, /*sp=*/true);
  recompute.recompute = scheduler::recompute_policy::full;
  const std::vector<row> rows = {{plan_of(1, 1, 2, /*sp=*/true), true},
                                 {plan_of(1, 2, 1), true},
                                 {plan_of(2, 2, 2), true},
                                 {interleaved, false},
                                 {zero_bubble, false},
                                 {tp_zero3, false},
                                 {recompute, false}};
  const train_config c = bf16_run();
  for (bool llama : {false, true}) {
    temp_dir tmp;
    const std::string ref_dir = (tmp / "single").string();
    const auto ref = single(llama, c, ref_dir);
    const auto exact = exact_single(llama, c);
    for (const auto& [plan, llama_too] : rows) {
      if (llama && !llama_too) continue;
      INFO((llama ? "llama " : "gpt-2 ") << scheduler::describe(plan));
      const std::string dir = (tmp / "plan").string();
      const auto got = planned(llama, c, plan, dir);
      INFO("rank 0: " << got.described);
      CHECK(got.described.find("bf16 with f32 master weights") != std::string::npos);
      check_steps(got.steps, ref, exact.run);
      check_weights(llama, dir, ref_dir, exact);
    }
  }
}

// A bf16 plan's checkpoint holds the f32 master weights and AdamW's moments in the whole layout,
// as an f32 plan's: 3 steps under tp2 + SP, the rest under dp2 x pp2, and in one process, end as
// accurately as the uninterrupted single-process bf16 run; so does the single process's bf16
// checkpoint resumed under pp2 x tp2.
TEST_CASE("bf16 checkpoints move between plans and the single process", "[parallel]") {
  const train_config c = bf16_run();
  temp_dir tmp;
  const std::string ref_dir = (tmp / "single").string();
  const auto ref = single(false, c, ref_dir);
  const auto exact = exact_single(false, c);
  const std::string half = (tmp / "half").string();
  save_first_steps_under_tp2(c, half);
  SECTION("under dp2 x pp2") {
    train_config rest = c;
    rest.resume = half;
    const std::string dir = (tmp / "rest").string();
    const auto got = planned(false, rest, plan_of(2, 2, 1), dir);
    REQUIRE(got.steps.size() == 3);
    std::vector<step_result> want(ref.begin() + 3, ref.end());
    testing::exact_run x = exact.run;
    x.loss.erase(x.loss.begin(), x.loss.begin() + 3);
    x.grad_norm.erase(x.grad_norm.begin(), x.grad_norm.begin() + 3);
    check_steps(got.steps, want, x);
    check_weights(false, dir, ref_dir, exact);
  }
  SECTION("from one process") {
    // The single process's bf16 checkpoint after 3 steps, resumed under pp2 x tp2.
    const std::string from = (tmp / "from-one").string();
    save_first_steps_in_one_process(c, dtype::bf16, from);
    train_config rest = c;
    rest.resume = from;
    const std::string dir = (tmp / "rest").string();
    const auto got = planned(false, rest, plan_of(1, 2, 2), dir);
    REQUIRE(got.steps.size() == 3);
    std::vector<step_result> want(ref.begin() + 3, ref.end());
    testing::exact_run x = exact.run;
    x.loss.erase(x.loss.begin(), x.loss.begin() + 3);
    x.grad_norm.erase(x.grad_norm.begin(), x.grad_norm.begin() + 3);
    check_steps(got.steps, want, x);
    check_weights(false, dir, ref_dir, exact);
  }
  SECTION("in one process") {
    const auto model = model_of(false);
    auto m = make_causal_lm(model, {c.batch, c.seq}, dtype::bf16);
    trainer t(*m, c);
    REQUIRE(t.resume(half, model).value() == 3);
    std::vector<step_result> got;
    for (int s = 3; s < c.steps; ++s) got.push_back(t.step(rows_of));
    const std::string dir = (tmp / "one").string();
    t.save(dir, model).value();
    std::vector<step_result> want(ref.begin() + 3, ref.end());
    testing::exact_run x = exact.run;
    x.loss.erase(x.loss.begin(), x.loss.begin() + 3);
    x.grad_norm.erase(x.grad_norm.begin(), x.grad_norm.begin() + 3);
    check_steps(got, want, x);
    check_weights(false, dir, ref_dir, exact);
  }
}

TEST_CASE("The bf16 rule tells a plan that loses half its tokens from the single process",
          "[parallel]") {
  // The rule above must be able to fail at bf16's rounding, not only at f32's: the tp2 + SP run
  // of half the rows per step (what a plan that loses a microbatch or a data-parallel rank's
  // gradients computes) is judged against the single process of the full batch and refused. (A
  // dropped tensor-parallel reduction was also seen to fail the first test, breaking the code
  // locally: see models/parallel/README.md.)
  train_config c = bf16_run();
  temp_dir tmp;
  const auto ref = single(false, c, (tmp / "single").string());
  const auto exact = exact_single(false, c);
  train_config wrong = c;
  wrong.batch = 2;  // half the tokens per step
  const auto got = planned(false, wrong, plan_of(1, 1, 2, true), (tmp / "plan").string());
  const auto v = judge_steps(got.steps, ref, exact.run);
  INFO("losses: " << v.losses.str());
  INFO("gradient norms: " << v.norms.str());
  CHECK_FALSE(v.losses.ok());
  CHECK_FALSE(v.norms.ok());
}

TEST_CASE("Every plan in f16 skips the single process's steps and trains as accurately",
          "[parallel]") {
  struct row {
    scheduler::parallel_plan plan;
    bool llama_too;
  };
  auto dp = [](int zero) {
    auto p = plan_of(2, 1, 1);
    p.zero = zero;
    return p;
  };
  auto interleaved = plan_of(1, 2, 1);
  interleaved.schedule = scheduler::schedule_kind::interleaved;
  interleaved.virtual_stages = 2;
  const std::vector<row> rows = {{dp(0), false},
                                 {dp(1), false},
                                 {dp(2), false},
                                 {dp(3), true},
                                 {plan_of(1, 1, 2, /*sp=*/true), true},
                                 {plan_of(1, 2, 1), true},
                                 {interleaved, false},
                                 {plan_of(2, 2, 2), true}};
  const train_config c = f16_run();
  for (bool llama : {false, true}) {
    temp_dir tmp;
    const std::string ref_dir = (tmp / "single").string();
    const auto ref = single(llama, c, ref_dir);
    if (std::getenv("TROUPE_ROUNDING_REPORT") != nullptr)
      std::printf("%s single f16 scales:%s\n", llama ? "llama" : "gpt-2", scale_line(ref).c_str());
    // The run this test is about: steps skipped at the start and again after the scale grew.
    int skipped = 0;
    bool grew = false;
    for (std::size_t s = 0; s < ref.size(); ++s) {
      skipped += ref[s].skipped ? 1 : 0;
      grew = grew || (s > 0 && ref[s].loss_scale > ref[s - 1].loss_scale);
    }
    INFO("single process scales:" << scale_line(ref));
    REQUIRE(skipped >= 2);
    REQUIRE(grew);
    const auto exact = exact_f16(llama, c, ref);
    for (const auto& [plan, llama_too] : rows) {
      if (llama && !llama_too) continue;
      INFO((llama ? "llama " : "gpt-2 ") << scheduler::describe(plan));
      const std::string dir = (tmp / "plan").string();
      const auto got = planned(llama, c, plan, dir);
      INFO("rank 0: " << got.described);
      INFO("plan scales:" << scale_line(got.steps));
      CHECK(got.described.find("f16 with f32 master weights and dynamic loss scaling") !=
            std::string::npos);
      check_scales(got.steps, ref);
      check_f16_steps(got.steps, ref, exact.run);
      check_weights(llama, dir, ref_dir, exact);
    }
  }
}

// The loss scaler's state (scale, good steps in a row) is in the checkpoint: 3 steps under tp2 + SP
// (two skipped, one good: scale 2^17, one good step counted) go on under dp2 x pp2 and in one
// process, and the single process's checkpoint after 3 steps goes on under pp2 x tp2, each with
// the uninterrupted single process's skips and scales - the scale grows at step 5 only when the
// good step counted before the save is carried - and as accurate as it by the rule above.
TEST_CASE("f16 checkpoints carry the loss scale between plans and the single process",
          "[parallel]") {
  const train_config c = f16_run();
  temp_dir tmp;
  const std::string ref_dir = (tmp / "single").string();
  const auto ref = single(false, c, ref_dir);
  const auto exact = exact_f16(false, c, ref);
  REQUIRE(ref[3].loss_scale == ref[2].loss_scale);
  REQUIRE(ref[4].loss_scale == 2 * ref[3].loss_scale);  // grows after the 2nd good step
  const std::vector<step_result> want(ref.begin() + 3, ref.end());
  testing::exact_run x = exact.run;
  x.loss.erase(x.loss.begin(), x.loss.begin() + 3);
  x.grad_norm.erase(x.grad_norm.begin(), x.grad_norm.begin() + 3);
  auto check_rest = [&](const std::vector<step_result>& got, const std::string& dir) {
    INFO("resumed scales:" << scale_line(got));
    check_scales(got, want);
    check_f16_steps(got, want, x);
    check_weights(false, dir, ref_dir, exact);
  };
  const std::string half = (tmp / "half").string();
  save_first_steps_under_tp2(c, half);
  SECTION("under dp2 x pp2") {
    train_config rest = c;
    rest.resume = half;
    const std::string dir = (tmp / "rest").string();
    const auto got = planned(false, rest, plan_of(2, 2, 1), dir);
    check_rest(got.steps, dir);
  }
  SECTION("in one process") {
    const auto model = model_of(false);
    auto m = make_causal_lm(model, {c.batch, c.seq}, dtype::f16);
    trainer t(*m, c);
    REQUIRE(t.resume(half, model).value() == 3);
    std::vector<step_result> got;
    for (int s = 3; s < c.steps; ++s) got.push_back(t.step(rows_of));
    const std::string dir = (tmp / "one").string();
    t.save(dir, model).value();
    check_rest(got, dir);
  }
  SECTION("from one process") {
    const std::string from = (tmp / "from-one").string();
    save_first_steps_in_one_process(c, dtype::f16, from);
    train_config rest = c;
    rest.resume = from;
    const std::string dir = (tmp / "rest").string();
    const auto got = planned(false, rest, plan_of(1, 2, 2), dir);
    check_rest(got.steps, dir);
  }
}

namespace {

// A piece that makes one parameter's gradient +inf on its rank at one step (after its backward):
// an overflow only that rank sees.
class overflow_at final : public grad_producer {
 public:
  overflow_at(grad_producer& inner, int step, const tensor* grad)
      : inner_(inner), step_(step), grad_(grad) {}
  layer_memory& memory() override { return inner_.memory(); }
  const slot_list& slots() const override { return inner_.slots(); }
  double forward_backward(int microbatches,
                          const std::function<microbatch_data(int k)>& fetch) override {
    const double loss = inner_.forward_backward(microbatches, fetch);
    if (calls_++ == step_ && grad_ != nullptr)
      ops::fill(grad_->reshape({grad_->numel()}).narrow(0, 0, 1),
                std::numeric_limits<double>::infinity());
    return loss;
  }
  collective::communicator* norm_group() override { return inner_.norm_group(); }
  bool counts_in_norm(const tensor_slot& p) const override { return inner_.counts_in_norm(p); }

 private:
  grad_producer& inner_;
  int step_, calls_ = 0;
  const tensor* grad_;
};

}  // namespace

// The overflow decision is the grid's, not a rank's: under dp2 x tp2 an inf in the gradient of a
// LayerNorm weight on one rank only (dp rank 1, tensor shard 1: a replica that shard does not count
// in the gradient norm, so the norm does not see it; under ZeRO 2 its f32 gradient is reduced into
// another rank's chunk) skips step 2 on all four ranks, halves the scale on all four and leaves
// every rank's weights as they were. (Checked to fail with the flag's reduction removed from
// dp_trainer::any_rank_overflowed: the other three ranks then update.)
TEST_CASE("An f16 overflow on one rank skips the step on every rank of the grid", "[parallel]") {
  for (int zero : {0, 2}) {
    INFO("zero " << zero);
    train_config c = f16_run();
    c.steps = 3;
    c.loss_scale = 1024;  // no natural overflow at this scale (the rows above: 2^10 fits)
    c.loss_scale_growth = 2000;
    c.plan = plan_of(2, 1, 2, /*sp=*/true);
    c.plan.zero = zero;
    const auto model = model_of(false);
    const int n = c.plan.world_size();
    std::vector<std::vector<step_result>> got(static_cast<std::size_t>(n));
    std::vector<int> unchanged(static_cast<std::size_t>(n), 0), changed(unchanged);
    run_plan(c.plan, [&](int r, const hybrid_groups& g) {
      const batch_dims dims{dp_trainer::microbatch_rows(c), c.seq};
      std::unique_ptr<causal_lm> m;
      with_family(model, [&](auto family, auto mc) {
        using F = typename decltype(family)::type;
        if constexpr (tp_family<F>)
          m = std::make_unique<causal_lm_of<tp_model<F>>>(mc, dims, tp_group{g.tp, true},
                                                          dtype::f16);
      });
      REQUIRE(m != nullptr);
      m->init_weights(c.seed);
      model_producer producer(*m, *g.tp);
      const tensor* target = nullptr;
      if (g.dp->rank() == 1 && g.tp->rank() == 1)
        for (const auto& s : producer.slots().slots())
          if (s.kind == slot_kind::param && !producer.counts_in_norm(s) &&
              s.name.find("ln") != std::string::npos) {
            target = s.grad;
            break;
          }
      REQUIRE((target != nullptr) == (g.dp->rank() == 1 && g.tp->rank() == 1));
      overflow_at inject(producer, 1, target);
      mixed_piece piece(inject);
      dp_trainer t(piece, c, *g.dp);
      auto weights = [&] {
        if (zero != 0) t.gather_full_parameters();
        return testing::flat(piece.memory().params());
      };
      got[r].push_back(t.step(rows_of));
      const auto before = weights();
      got[r].push_back(t.step(rows_of));
      unchanged[r] = weights() == before ? 1 : 0;
      got[r].push_back(t.step(rows_of));
      changed[r] = weights() != before ? 1 : 0;
    });
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r << " scales:" << scale_line(got[r]));
      CHECK(!got[r][0].skipped);
      CHECK(got[r][1].skipped);
      CHECK(!got[r][2].skipped);
      CHECK(got[r][1].loss_scale == 1024);
      CHECK(got[r][2].loss_scale == 512);
      CHECK(unchanged[r] == 1);
      CHECK(changed[r] == 1);
    }
  }
}

// Context parallelism in 16 bits. Ring attention (models/layers/ring_attention.hpp): the key/value
// blocks travel in bf16 / f16 and every block is computed from them in f32 with the online-softmax
// statistics in f32, out and the gradients rounded once, as the single-rank kernel rounds its
// results once. So a ring run rounds where the single process does plus the f32 merges; Ulysses
// moves 16-bit heads (copies, no rounding) and runs the single process's kernel on them. cp2
// (whole model per rank) and cp2 x pp2 (1F1B over 4 microbatches) train as accurately as the
// single process in bf16 by the rule above, and in f16 skip the single process's steps with its
// scales. seq 8: two zigzag chunks of 2 tokens per ring rank.
TEST_CASE(
    "Ring and Ulysses context parallelism in bf16 and f16 under cp2 and cp2 x pp2 train like the "
    "single process",
    "[parallel][cp]") {
  auto cp2 = [](int pp, scheduler::cp_mode_kind mode) {
    auto p = plan_of(1, pp, 1);
    p.cp = 2;
    p.cp_mode = mode;
    return p;
  };
  for (const std::string precision : {"bf16", "f16"}) {
    train_config c = precision == "bf16" ? bf16_run() : f16_run();
    for (bool llama : {false, true}) {
      temp_dir tmp;
      const std::string ref_dir = (tmp / "single").string();
      const auto ref = single(llama, c, ref_dir);
      const auto exact = precision == "bf16" ? exact_single(llama, c) : exact_f16(llama, c, ref);
      for (auto mode : {scheduler::cp_mode_kind::ring, scheduler::cp_mode_kind::ulysses})
        for (int pp : {1, 2}) {
          const auto plan = cp2(pp, mode);
          INFO((llama ? "llama " : "gpt-2 ") << precision << " " << scheduler::describe(plan));
          const std::string dir = (tmp / "plan").string();
          const auto got = planned(llama, c, plan, dir);
          INFO("rank 0: " << got.described);
          CHECK(got.described.find(mode == scheduler::cp_mode_kind::ring
                                       ? "ring attention"
                                       : "Ulysses") != std::string::npos);
          CHECK(got.described.find(precision + " with f32 master weights") != std::string::npos);
          if (precision == "bf16") {
            check_steps(got.steps, ref, exact.run);
          } else {
            check_scales(got.steps, ref);
            check_f16_steps(got.steps, ref, exact.run);
          }
          check_weights(llama, dir, ref_dir, exact);
        }
    }
  }
}
