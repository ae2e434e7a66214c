// Post-training under parallel plans (plan_samples.hpp): SFT (packed rows too), DPO, GRPO and PPO
// policy steps of hybrid_trainer::step(samples) under dp2 (ZeRO 0, 2, 3), tp2 + SP, pp2 and dp2 x
// tp2 x pp2 train as the single-process steps (sft_micro_batch, dpo_micro_batch, grpo_micro_batch,
// ppo_policy_micro_batch) at the same rows, by the f32 rule (tests/rounding.hpp,
// models/parallel/exact_run.hpp): each run's losses and gradient norms within tests::trajectory_k,
// and its final weights within tests::default_k, of the single process's own error against the
// f64 single process. The plans add the same terms in other orders (the vocab-parallel
// log-softmax, the microbatches' weighted sums, the reductions), so both f32 runs sit at f32
// rounding from the exact run, while a plan that loses a mask or an objective on one rank is off
// by O(1) in its gradient (the last test).
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/testing.hpp"
#include "models/parallel/exact_run.hpp"
#include "models/parallel/hybrid.hpp"
#include "models/parallel/plan_threads.hpp"
#include "models/parallel/testing.hpp"
#include "models/post/dpo_step.hpp"
#include "models/post/grpo_step.hpp"
#include "models/post/plan_samples.hpp"
#include "models/post/ppo_step.hpp"
#include "models/post/sft_step.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
using troupe::models::hf::testing::temp_dir;
using troupe::models::testing::run_plan;

namespace {

constexpr std::int64_t rows_per_step = 8, seq = 8;

hf::model_config model_of(bool llama = false) {
  return named_model_config(llama ? "llama-tiny" : "gpt2-demo", 64).value();
}

train_config run_config() {
  train_config c;
  c.steps = 3;
  c.batch = rows_per_step;
  c.seq = seq;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 1;
  c.clip = 1.0;
  c.seed = 5;
  return c;
}

scheduler::parallel_plan plan_of(int dp, int pp, int tp, int zero = 0) {
  scheduler::parallel_plan p;
  p.dp = dp;
  p.pp = pp;
  p.tp = tp;
  p.sp = tp > 1;
  p.zero = zero;
  p.microbatches = pp > 1 ? 2 : 1;  // an even number of rows per microbatch (DPO's pairs)
  return p;
}

std::vector<std::int32_t> random_ids(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  std::vector<std::int32_t> v(n);
  for (auto& x : v) x = static_cast<std::int32_t>(g() % 64);
  return v;
}

// Rows of two conversations (packed: the second starts at position 2 + row mod 5, a different
// boundary per row and microbatch, mostly off the middle so a sequence-parallel shard's positions
// differ between shards) or one (unpacked), trained on each conversation's tokens after its first
// (packed) or first two (unpacked).
std::shared_ptr<sft_rows> sft_data(bool packed) {
  auto r = std::make_shared<sft_rows>();
  r->seq = seq;
  const std::int64_t n = 12;  // 1.5 steps' worth: the draws wrap around
  r->ids = random_ids(static_cast<std::size_t>(n * seq), 11);
  for (std::int64_t i = 0; i < n * seq; ++i) {
    const std::int64_t split = packed ? 2 + (i / seq) % 5 : 0;
    const std::int64_t t = i % seq, second = split > 0 && t >= split ? 1 : 0;
    const std::int64_t in = t - second * split, end = second || split == 0 ? seq : split;
    r->segments.push_back(static_cast<std::int32_t>(second));
    r->positions.push_back(static_cast<std::int32_t>(in));
    const bool trained = in >= (packed ? 1 : 2) && t + 1 < end;
    r->targets.push_back(trained ? r->ids[static_cast<std::size_t>(i + 1)] : -100);
  }
  return r;
}

// Four pairs: a shared prompt of 3 tokens, then each response (trained on).
std::shared_ptr<preference_rows> dpo_data() {
  auto r = std::make_shared<preference_rows>();
  r->seq = seq;
  const std::int64_t pairs = 6;
  r->ids = random_ids(static_cast<std::size_t>(2 * pairs * seq), 12);
  for (std::int64_t p = 0; p < pairs; ++p)  // the rejected row's prompt is the chosen one's
    for (std::int64_t t = 0; t < 3; ++t)
      r->ids[static_cast<std::size_t>((2 * p + 1) * seq + t)] =
          r->ids[static_cast<std::size_t>(2 * p * seq + t)];
  for (std::int64_t i = 0; i < 2 * pairs * seq; ++i) {
    const std::int64_t t = i % seq;
    r->targets.push_back(t >= 2 && t + 1 < seq ? r->ids[static_cast<std::size_t>(i + 1)] : -100);
  }
  return r;
}

// Whether position t of row `row` is a sampled completion's token: after a prompt of 3, the
// completions end early by row % 3 tokens (5, 4 or 3 trained targets), so microbatches of a plan
// hold different numbers of completion tokens and a per-row weighting (GRPO's sequence mean) and a
// per-token one (PPO's token mean) give different steps.
bool completion_at(std::int64_t row, std::int64_t t) {
  return t >= 2 && t + 1 < seq - row % 3;
}

// Eight sampled rows (prompt of 3, completions of uneven length) in groups of 4, with old
// log-probabilities near the initial policy's (so some ratios leave the clip range) and a
// reference.
std::shared_ptr<grpo_batch> grpo_data(const train_config& c, const hf::model_config& model) {
  auto b = std::make_shared<grpo_batch>();
  b->rows = rows_per_step;
  b->seq = seq;
  b->ids = random_ids(static_cast<std::size_t>(b->rows * seq), 13);
  for (std::int64_t i = 0; i < b->rows * seq; ++i)
    b->targets.push_back(completion_at(i / seq, i % seq) ? b->ids[static_cast<std::size_t>(i + 1)]
                                                         : -100);
  auto m = make_causal_lm(model, {b->rows, seq});
  m->init_weights(c.seed);
  const auto logp =
      token_logprobs_of(*m, i32_rows(b->ids, b->rows, seq), i32_rows(b->targets, b->rows, seq));
  std::mt19937_64 g(14);
  std::uniform_real_distribution<double> u(-0.3, 0.3);
  for (double lp : logp) {
    b->old_logp.push_back(lp == 0 ? 0.0 : lp + u(g));
    b->ref_logp.push_back(lp == 0 ? 0.0 : lp + u(g));
  }
  std::vector<double> rewards;
  for (std::int64_t i = 0; i < b->rows; ++i) rewards.push_back(u(g) > 0 ? 1.0 : 0.25 * i);
  b->advantages = group_advantages(rewards, 4);
  return b;
}

// What a post-training job is, for the three runs that compare: the single process's micro-batch
// (f32 and f64) and the plan's sample source.
struct job {
  std::function<trainer::micro_batch(causal_lm& reference)> single;
  std::function<sample_source()> planned;
  hf::model_config model;
};

struct single_run {
  std::vector<step_result> steps;
  std::unique_ptr<causal_lm> model;
};

single_run run_single(const job& j, const train_config& c, dtype t) {
  train_config cc = c;
  if (t == dtype::f64) cc.precision = "f64";
  single_run out;
  out.model = make_causal_lm(j.model, {c.batch, c.seq}, t);
  auto reference = make_causal_lm(j.model, {c.batch, c.seq}, t);
  if (t == dtype::f64) {  // the f32 init, widened (exact)
    auto f32 = make_causal_lm(j.model, {c.batch, c.seq});
    f32->init_weights(c.seed);
    ops::copy(f32->memory().params(), out.model->memory().params());
    ops::copy(f32->memory().params(), reference->memory().params());
  } else {
    out.model->init_weights(c.seed);
    reference->init_weights(c.seed);
  }
  trainer tr(*out.model, cc);
  const auto mb = j.single(*reference);
  for (int s = 0; s < c.steps; ++s) out.steps.push_back(tr.step(mb));
  return out;
}

struct plan_run {
  std::vector<step_result> steps;    // rank 0's
  std::unique_ptr<causal_lm> model;  // the final weights, whole
};

plan_run run_planned(const job& j, train_config c, const scheduler::parallel_plan& plan,
                     const std::function<sample_source(int rank, sample_source)>& wrap = {}) {
  c.plan = plan;
  temp_dir tmp;
  const std::string dir = (tmp / "plan").string();
  std::vector<std::vector<step_result>> got(plan.world_size());
  run_plan(plan, [&](int r, const hybrid_groups& g) {
    hybrid_trainer t(j.model, c, g);
    sample_source src = j.planned();
    if (wrap) src = wrap(r, std::move(src));
    while (t.steps_done() < c.steps) got[r].push_back(t.step(src));
    t.save(dir);
  });
  for (int r = 1; r < plan.world_size(); ++r)
    for (std::size_t s = 0; s < got[0].size(); ++s) CHECK(got[r][s].loss == got[0][s].loss);
  plan_run out{got[0], make_whole_model(j.model, seq)};
  hf::load_weights(dir, j.model, out.model->slots()).value();
  return out;
}

// The weights of `m` in the order of `order`'s parameters (by name), as f64.
std::vector<double> weights_of(const causal_lm& m, const causal_lm& order) {
  std::vector<double> out;
  for (const auto& s : order.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    const tensor_slot* p = testing::param_slot(m.slots(), s.name);
    REQUIRE(p != nullptr);
    const auto v = testing::as_f64(*p->field);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

struct verdicts {
  tests::rounding_verdict losses, norms, weights;
};

verdicts judge(const plan_run& got, const single_run& ref, const single_run& exact) {
  std::vector<double> gl, rl, xl, gn, rn, xn;
  for (std::size_t s = 0; s < exact.steps.size(); ++s) {
    gl.push_back(got.steps.at(s).loss);
    rl.push_back(ref.steps.at(s).loss);
    xl.push_back(exact.steps.at(s).loss);
    gn.push_back(got.steps.at(s).grad_norm);
    rn.push_back(ref.steps.at(s).grad_norm);
    xn.push_back(exact.steps.at(s).grad_norm);
  }
  return {tests::as_accurate_as(gl, rl, xl, tests::trajectory_k),
          tests::as_accurate_as(gn, rn, xn, tests::trajectory_k),
          tests::as_accurate_as(weights_of(*got.model, *exact.model),
                                weights_of(*ref.model, *exact.model),
                                weights_of(*exact.model, *exact.model))};
}

void check_plans(const job& j, const std::vector<scheduler::parallel_plan>& plans) {
  const train_config c = run_config();
  const single_run ref = run_single(j, c, dtype::f32);
  const single_run exact = run_single(j, c, dtype::f64);
  for (const auto& plan : plans) {
    INFO(scheduler::describe(plan));
    const plan_run got = run_planned(j, c, plan);
    const verdicts v = judge(got, ref, exact);
    INFO("losses: " << v.losses.str());
    INFO("gradient norms: " << v.norms.str());
    INFO("weights: " << v.weights.str());
    CHECK(v.losses.ok());
    CHECK(v.norms.ok());
    CHECK(v.weights.ok());
    if (std::getenv("TROUPE_ROUNDING_REPORT") != nullptr)
      std::printf("%s: ratios losses %.3g, norms %.3g, weights %.3g\n",
                  scheduler::describe(plan).c_str(), v.losses.ratio(), v.norms.ratio(),
                  v.weights.ratio());
  }
}

// GPipe with 4 microbatches: the last stage runs every forward before the backwards, so each
// microbatch's objective and row weights go to its stash and come back (with recompute, a
// restored microbatch's head runs its objective again).
scheduler::parallel_plan gpipe(bool recompute) {
  auto p = plan_of(1, 2, 1);
  p.schedule = scheduler::schedule_kind::gpipe;
  p.microbatches = 4;
  if (recompute) p.recompute = scheduler::recompute_policy::full;
  return p;
}

const std::vector<scheduler::parallel_plan> every_plan = {
    plan_of(2, 1, 1, 0), plan_of(2, 1, 1, 2), plan_of(2, 1, 1, 3), plan_of(1, 1, 2),
    plan_of(1, 2, 1),    gpipe(false),        gpipe(true),         plan_of(2, 2, 2)};

job sft_job(bool packed, bool llama = false) {
  auto rows = sft_data(packed);
  return {[rows](causal_lm&) { return sft_micro_batch(rows, rows_per_step); },
          [rows, packed] { return sft_samples(rows, rows_per_step, 1, packed); }, model_of(llama)};
}

scheduler::parallel_plan without_sp(scheduler::parallel_plan p) {
  p.sp = false;
  return p;
}

scheduler::parallel_plan interleaved(scheduler::parallel_plan p) {
  p.schedule = scheduler::schedule_kind::interleaved;
  p.virtual_stages = 2;
  return p;
}

scheduler::parallel_plan recomputed(scheduler::parallel_plan p) {
  p.recompute = scheduler::recompute_policy::full;
  return p;
}

// Packed rows under tensor shards and stages: tp2 with SP, without, and with recompute (the
// blocks' forwards run again in backward), pp2 1F1B and interleaved, GPipe with recompute (each
// microbatch's segments stashed and restored, its stage's forward run again), dp2 x tp2 x pp2.
const std::vector<scheduler::parallel_plan> packed_plans = {
    plan_of(1, 1, 2), without_sp(plan_of(1, 1, 2)),  recomputed(plan_of(1, 1, 2)),
    plan_of(1, 2, 1), interleaved(plan_of(1, 2, 1)), gpipe(true),
    plan_of(2, 2, 2)};

job dpo_job(const dpo_options& opt, bool llama = false) {
  auto rows = dpo_data();
  // The reference's log-probabilities for the plans: the initial weights in f32, in pairs.
  auto reference = make_causal_lm(model_of(llama), {2, seq});
  reference->init_weights(run_config().seed);
  auto ref_logp =
      std::make_shared<const std::vector<double>>(dpo_reference_logprobs(*reference, *rows, opt));
  return {
      [rows, opt](causal_lm& ref) { return dpo_micro_batch(rows, ref, rows_per_step / 2, opt); },
      [rows, ref_logp, opt] { return dpo_samples(rows, ref_logp, opt); }, model_of(llama)};
}

// PPO's policy batch: GRPO's rows, old log-probabilities and (per token) advantages of its
// rewards varied along the completion.
std::shared_ptr<ppo_batch> ppo_data(const train_config& c, const hf::model_config& model) {
  const auto g = grpo_data(c, model);
  auto b = std::make_shared<ppo_batch>();
  b->rows = g->rows;
  b->seq = g->seq;
  b->ids = g->ids;
  b->targets = g->targets;
  b->old_logp = g->old_logp;
  for (std::int64_t i = 0; i < b->rows * seq; ++i)
    b->advantages.push_back(g->advantages[static_cast<std::size_t>(i / seq)] +
                            0.1 * static_cast<double>(i % seq));
  return b;
}

job ppo_job() {
  auto batch = ppo_data(run_config(), model_of());
  const ppo_options opt{};
  return {[batch, opt](causal_lm&) { return ppo_policy_micro_batch(batch, opt); },
          [batch, opt] { return ppo_samples(batch, opt); }, model_of()};
}

job grpo_job(bool llama = false) {
  auto batch = grpo_data(run_config(), model_of(llama));
  const grpo_options opt{.epsilon = 0.2, .beta = 0.04};
  return {[batch, opt](causal_lm&) { return grpo_micro_batch(batch, opt); },
          [batch, opt] { return grpo_samples(batch, opt); }, model_of(llama)};
}

}  // namespace

TEST_CASE("SFT steps under every plan train as the single-process SFT step", "[parallel][post]") {
  SECTION("packed rows, whole models under dp2 (ZeRO 0, 2, 3)") {
    check_plans(sft_job(true), {every_plan[0], every_plan[1], every_plan[2]});
  }
  SECTION("one conversation per row, every plan") {
    check_plans(sft_job(false), every_plan);
  }
}

TEST_CASE("Packed SFT rows under tensor shards and stages train as the single-process packed step",
          "[parallel][post]") {
  // Every shard's attention heads and every stage's blocks stay within a row's conversations, and
  // GPT-2's learned positions restart per conversation on the shard (or stage) holding the front.
  SECTION("GPT-2") {
    check_plans(sft_job(true), packed_plans);
  }
  SECTION("Llama") {
    check_plans(sft_job(true, true),
                {packed_plans[0], packed_plans[3], packed_plans[4], packed_plans[6]});
  }
}

TEST_CASE("DPO steps under every plan train as the single-process DPO step", "[parallel][post]") {
  SECTION("sigmoid") {
    check_plans(dpo_job({}), every_plan);
  }
  SECTION("IPO") {
    check_plans(dpo_job({.type = dpo_loss_type::ipo, .beta = 0.5}),
                {every_plan[0], every_plan[3], every_plan[6], every_plan[7]});
  }
}

TEST_CASE("GRPO steps under every plan train as the single-process GRPO step", "[parallel][post]") {
  check_plans(grpo_job(), every_plan);
}

// ppo_samples weighs each microbatch by its share of the batch's completion tokens (PPO's loss is
// a token mean over the batch); with uneven completions a per-row weight is off by O(1).
TEST_CASE("PPO policy steps under every plan train as the single-process PPO step",
          "[parallel][post]") {
  check_plans(ppo_job(), every_plan);
}

TEST_CASE("Llama's DPO and GRPO steps under tensor shards and stages train as one process's",
          "[parallel][post]") {
  // The Llama head (RMSNorm, untied lm_head) through the same vocab-parallel objective.
  const std::vector<scheduler::parallel_plan> plans = {every_plan[0], every_plan[3], every_plan[5],
                                                       every_plan[7]};
  SECTION("DPO") {
    check_plans(dpo_job({}, true), plans);
  }
  SECTION("GRPO") {
    check_plans(grpo_job(true), plans);
  }
}

TEST_CASE("A plan that drops the SFT mask on one rank is told from the single process",
          "[parallel][post]") {
  // Data-parallel rank 1 trains on every next token of its rows (the mask dropped there), as a
  // plan that lost the masking on one rank would: the rule above must refuse it.
  const job j = sft_job(false);
  const train_config c = run_config();
  const single_run ref = run_single(j, c, dtype::f32);
  const single_run exact = run_single(j, c, dtype::f64);
  auto unmask = [](int rank, sample_source src) -> sample_source {
    if (rank == 0) return src;
    auto buf = std::make_shared<std::vector<std::int32_t>>();
    return [src = std::move(src), buf](const sample_request& r) {
      microbatch_data mb = src(r);
      buf->assign(mb.targets.data_as<std::int32_t>(),
                  mb.targets.data_as<std::int32_t>() + mb.targets.numel());
      const auto* ids = mb.ids.data_as<std::int32_t>();
      for (std::size_t i = 0; i + 1 < buf->size(); ++i)
        if ((i + 1) % seq != 0) (*buf)[i] = ids[i + 1];
      mb.targets = tensor(buf->data(), buf->size() * 4, dtype::i32, mb.ids.sizes());
      return mb;
    };
  };
  const plan_run got = run_planned(j, c, plan_of(2, 1, 1), unmask);
  const verdicts v = judge(got, ref, exact);
  INFO("losses: " << v.losses.str());
  INFO("weights: " << v.weights.str());
  CHECK_FALSE(v.losses.ok());
  CHECK_FALSE(v.weights.ok());
  std::printf("mask dropped on dp rank 1: ratios losses %.3g, weights %.3g\n", v.losses.ratio(),
              v.weights.ratio());
}

TEST_CASE("A tensor shard or a stage that ignores the packing is told from the single process",
          "[parallel][post]") {
  // Model-parallel rank 1 (tensor shard 1, pipeline stage 1) gets its rows without their
  // segments and positions, as a piece that dropped the packing would run them: its attention
  // crosses the conversations (and, on a front, the positions run on), off by O(1) in the
  // losses, so the rule must refuse both plans.
  for (const bool llama : {false, true}) {
    const job j = sft_job(true, llama);
    const train_config c = run_config();
    const single_run ref = run_single(j, c, dtype::f32);
    const single_run exact = run_single(j, c, dtype::f64);
    auto unpack = [](int rank, sample_source src) -> sample_source {
      if (rank != 1) return src;
      return [src = std::move(src)](const sample_request& r) {
        microbatch_data mb = src(r);
        mb.segments = mb.positions = tensor{};
        return mb;
      };
    };
    for (const auto& plan : {plan_of(1, 1, 2), plan_of(1, 2, 1)}) {
      INFO((llama ? "Llama " : "GPT-2 ") << scheduler::describe(plan));
      const plan_run got = run_planned(j, c, plan, unpack);
      const verdicts v = judge(got, ref, exact);
      INFO("losses: " << v.losses.str());
      INFO("weights: " << v.weights.str());
      CHECK_FALSE(v.losses.ok());
      CHECK_FALSE(v.weights.ok());
      std::printf("%s packing dropped on rank 1 of %s: ratios losses %.3g, weights %.3g\n",
                  llama ? "Llama" : "GPT-2", scheduler::describe(plan).c_str(), v.losses.ratio(),
                  v.weights.ratio());
    }
  }
}
