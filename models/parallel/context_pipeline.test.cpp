// Context parallelism inside pipeline stages (context_pipeline.hpp) under hybrid_trainer, ranks as
// threads of one process: Ulysses and ring cp2 x pp2 (1F1B, interleaved and zero-bubble, with and
// without recompute, and under dp2 with ZeRO 0 and 2) train GPT-2 and grouped-query Llama as the
// single-process trainer does at the same tokens per step, by the f32 rule (tests/rounding.hpp,
// exact_run.hpp): the losses, gradient norms and final weights as accurate as the single process's
// against its f64 twin. Checkpoints saved under cp x pp continue in one process and the other way
// round; a train.seq beyond the model's positions and cp with tp are refused by name.
#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <string>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/testing.hpp"
#include "models/parallel/exact_run.hpp"
#include "models/parallel/hybrid.hpp"
#include "models/parallel/plan_threads.hpp"
#include "models/parallel/testing.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
using troupe::models::hf::testing::temp_dir;
using troupe::scheduler::cp_mode_kind;
namespace t = troupe::models::testing;

namespace {

hf::model_config tiny_model(bool llama) {
  return named_model_config(llama ? "llama-tiny" : "gpt2-demo", 29).value();
}

// Rows of `seq` tokens from a fixed pseudo-random stream, a pure function of the draw.
void rows_of(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3 + (i * draw) % 5) % 29);
}

train_config tiny_run() {
  train_config c;
  c.steps = 8;
  c.batch = 4;
  c.seq = 8;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.5;  // the first steps' norms exceed it, so clipping runs on the reduced gradients
  c.eps = 1e-6;  // as data_parallel.test.cpp: keeps AdamW's magnified rounding noise small
  c.seed = 5;
  return c;
}

struct run_result {
  std::vector<step_result> steps;
  std::vector<float> params;
  std::string described;  // rank 0's piece
};

run_result single(bool llama, const train_config& c) {
  run_result r;
  auto m = make_causal_lm(tiny_model(llama), {c.batch, c.seq});
  m->init_weights(c.seed);
  trainer tr(*m, c);
  for (int s = 0; s < c.steps; ++s) r.steps.push_back(tr.step(rows_of));
  const tensor& p = m->memory().params();
  r.params.assign(p.data_as<float>(), p.data_as<float>() + p.numel());
  return r;
}

// Steps [0 or the checkpoint's, last) under `plan`, from checkpoint `from` when given, saved into
// `dir`; params: the saved weights read back in the single process's layout.
run_result planned_span(bool llama, train_config c, const scheduler::parallel_plan& plan, int last,
                        const std::string& from, const std::string& dir) {
  c.plan = plan;
  c.resume = from;
  const auto model = tiny_model(llama);
  std::vector<run_result> got(plan.world_size());
  t::run_plan(plan, [&](int r, const hybrid_groups& g) {
    hybrid_trainer tr(model, c, g);
    got[r].described = tr.describe();
    while (tr.steps_done() < last) got[r].steps.push_back(tr.step(rows_of));
    tr.save(dir);
  });
  for (int r = 1; r < plan.world_size(); ++r)
    for (std::size_t s = 0; s < got[0].steps.size(); ++s)
      CHECK(got[r].steps[s].loss == got[0].steps[s].loss);
  auto whole = make_whole_model(model, c.seq);
  hf::load_weights(dir, model, whole->slots()).value();
  got[0].params = t::flat(whole->memory().params());
  return got[0];
}

// `c` under `plan` from its init (every rank must report the same losses), the final weights read
// back from the checkpoint it saves (the single process's layout).
run_result planned(bool llama, const train_config& c, const scheduler::parallel_plan& plan) {
  temp_dir tmp;
  return planned_span(llama, c, plan, c.steps, "", (tmp / "plan").string());
}

struct plan_row {
  cp_mode_kind mode;
  int dp, cp, pp;
  scheduler::schedule_kind schedule;
  bool recompute;
  int zero = 0;
};

scheduler::parallel_plan plan_of(const plan_row& row) {
  scheduler::parallel_plan p;
  p.dp = row.dp;
  p.cp = row.cp;
  p.pp = row.pp;
  p.cp_mode = row.mode;
  p.schedule = row.schedule;
  p.virtual_stages = row.schedule == scheduler::schedule_kind::interleaved ? 2 : 1;
  p.microbatches = 4 / row.dp;  // one row per microbatch: the first stage stashes 1F1B's in flight
  if (row.recompute) p.recompute = scheduler::recompute_policy::full;
  p.zero = row.zero;  // ZeRO 1, 2: sharded over the dp x cp ranks of a stage
  return p;
}

void check_rows(std::initializer_list<plan_row> rows) {
  for (bool llama : {false, true}) {
    const train_config c = tiny_run();
    const run_result ref = single(llama, c);
    auto x64 = make_causal_lm(tiny_model(llama), {c.batch, c.seq}, dtype::f64);
    x64->init_weights(c.seed);
    const t::exact_run exact = t::exact_training(*x64, c, rows_of);
    CHECK(ref.steps[0].grad_norm > c.clip);
    for (const auto& row : rows) {
      const auto plan = plan_of(row);
      INFO((llama ? "llama-tiny" : "gpt2-demo") << " " << scheduler::describe(plan));
      const run_result got = planned(llama, c, plan);
      INFO("rank 0: " << got.described);
      CHECK(got.described.find(row.mode == cp_mode_kind::ring ? "ring attention" : "Ulysses") !=
            std::string::npos);
      REQUIRE(got.steps.size() == ref.steps.size());
      for (int s = 0; s < c.steps; ++s) CHECK(got.steps[s].tokens == ref.steps[s].tokens);
      // The same terms as the single process's summed in another order (the attention merged
      // over ranks or over exchanged heads, the weight gradients over positions, microbatches and
      // ranks), which AdamW magnifies alike in both f32 runs: as accurate as the single process
      // against the f64 run (exact_run.hpp). A microbatch's heads or positions from another
      // microbatch, or a rank's share weighted wrong, is off by O(1) in the gradients.
      t::check_run_as_accurate(got, ref, exact);
    }
  }
}

constexpr auto one_f_one_b = scheduler::schedule_kind::one_f_one_b;
constexpr auto interleaved = scheduler::schedule_kind::interleaved;
constexpr auto zero_bubble = scheduler::schedule_kind::zero_bubble;

}  // namespace

TEST_CASE(
    "Ulysses cp2 x pp2 under 1F1B, interleaved and zero-bubble stages, and dp2 x cp2 x pp2 with "
    "ZeRO 2, trains like the single process for GPT-2 and grouped-query Llama",
    "[parallel][cp]") {
  // zero-bubble: split backwards, the weight passes deferred (the exchanges' heads are read in
  // the input-gradient pass, before the stash may move them).
  check_rows({{cp_mode_kind::ulysses, 1, 2, 2, one_f_one_b, false},
              {cp_mode_kind::ulysses, 1, 2, 2, interleaved, false},
              {cp_mode_kind::ulysses, 1, 2, 2, one_f_one_b, true},
              {cp_mode_kind::ulysses, 1, 2, 2, zero_bubble, false},
              {cp_mode_kind::ulysses, 2, 2, 2, one_f_one_b, false, 2}});
}

TEST_CASE(
    "Ring cp2 x pp2 under 1F1B, interleaved and zero-bubble stages and with recompute, and dp2 x "
    "cp2 x pp2 with ZeRO 0 and 2, train like the single process for GPT-2 and grouped-query Llama",
    "[parallel][cp]") {
  check_rows({{cp_mode_kind::ring, 1, 2, 2, one_f_one_b, false},
              {cp_mode_kind::ring, 1, 2, 2, interleaved, false},
              {cp_mode_kind::ring, 1, 2, 2, zero_bubble, false},
              {cp_mode_kind::ring, 1, 2, 2, one_f_one_b, true},
              {cp_mode_kind::ring, 2, 2, 2, one_f_one_b, false},
              {cp_mode_kind::ring, 2, 2, 2, one_f_one_b, false, 2}});
}

TEST_CASE("Context parallelism with tensor parallelism is refused naming parallel.tp",
          "[parallel][cp][faults]") {
  train_config c = tiny_run();
  scheduler::parallel_plan p;
  p.cp = 2;
  p.tp = 2;
  p.cp_mode = cp_mode_kind::ring;
  c.plan = p;
  std::string said;
  try {
    t::run_plan(p, [&](int, const hybrid_groups& g) { hybrid_trainer tr(tiny_model(true), c, g); });
  } catch (const std::exception& e) {
    said = e.what();
  }
  std::printf("faults: ring cp2 with tp2 -> refused: %s\n", said.c_str());
  CHECK_THAT(said, Catch::Contains("parallel.cp = 2 with parallel.tp = 2"));
}

TEST_CASE("A cp x pp plan whose train.seq exceeds the model's positions is refused naming max_seq",
          "[parallel][cp][faults]") {
  // Each stage is planned for seq / cp positions, which fit, but they are positions of the whole
  // sequence: GPT-2's learned positions past n_positions fall outside wpe. cp_piece refuses this
  // (context_parallel.cpp); the stages did not (seen: the first stage failed in step 1 in the
  // embedding op, naming no setting, and under Ulysses its cp peer was left waiting in a recv).
  auto gpt = std::get<hf::gpt2_config>(tiny_model(false));
  gpt.n_positions = 8;
  train_config c = tiny_run();
  c.seq = 16;  // 8 per cp rank: the stage's plan fits max_seq 8
  for (auto mode : {cp_mode_kind::ring, cp_mode_kind::ulysses}) {
    scheduler::parallel_plan p = plan_of({mode, 1, 2, 2, one_f_one_b, false});
    c.plan = p;
    std::string said;
    try {
      t::run_plan(p, [&](int, const hybrid_groups& g) {
        hybrid_trainer tr(hf::model_config(gpt), c, g);
        tr.step(rows_of);
      });
    } catch (const std::exception& e) {
      said = e.what();
    }
    std::printf("faults: %s cp2 x pp2 with train.seq 16 over n_positions 8 -> refused: %s\n",
                std::string(scheduler::name(mode)).c_str(), said.c_str());
    CHECK_THAT(said, Catch::Contains("train.seq = 16") && Catch::Contains("max_seq 8"));
  }
}

namespace {

// Steps [first, last) of the single-process trainer, from its init or from checkpoint `from`
// (then first is its step), saved into `dir`; params: the final weights.
run_result single_span(bool llama, train_config c, int first, int last, const std::string& from,
                       const std::string& dir) {
  const auto model = tiny_model(llama);
  c.resume = from;
  run_result r;
  auto m = make_causal_lm(model, {c.batch, c.seq});
  m->init_weights(c.seed);
  trainer tr(*m, c);
  if (!from.empty()) REQUIRE(tr.resume(from, model).value() == first);
  for (int s = first; s < last; ++s) r.steps.push_back(tr.step(rows_of));
  tr.save(dir, model).value();
  r.params = t::flat(m->memory().params());
  return r;
}

}  // namespace

TEST_CASE(
    "A run saved under cp2 x pp2 continues in one process, and one process's under cp2 x pp2, "
    "like the uninterrupted single process",
    "[parallel][cp]") {
  // The checkpoint holds the whole model's weights and AdamW moments (the stages' parts, each
  // ZeRO 1 shard over the dp x cp ranks of a stage gathered); resuming scatters them back. Both
  // halves joined must be as accurate as the uninterrupted single process by the f32 rule
  // (exact_run.hpp); a moment lost, scattered to the wrong rank or read from a cp peer's shard is
  // off by O(lr) in the weights.
  const int half = 4;
  for (bool llama : {false, true}) {
    INFO((llama ? "llama-tiny" : "gpt2-demo"));
    const train_config c = tiny_run();
    const run_result ref = single(llama, c);
    auto x64 = make_causal_lm(tiny_model(llama), {c.batch, c.seq}, dtype::f64);
    x64->init_weights(c.seed);
    const t::exact_run exact = t::exact_training(*x64, c, rows_of);
    temp_dir tmp;
    const std::string a = (tmp / "a").string(), b = (tmp / "b").string();
    const std::string d = (tmp / "d").string(), e = (tmp / "e").string();
    auto join = [](run_result first, const run_result& second) {
      first.steps.insert(first.steps.end(), second.steps.begin(), second.steps.end());
      first.params = second.params;
      return first;
    };
    // Ring cp2 x pp2 with ZeRO 1 for the first half, the single process for the rest.
    const auto ring = plan_of({cp_mode_kind::ring, 1, 2, 2, one_f_one_b, false, 1});
    const run_result r1 = planned_span(llama, c, ring, half, "", a);
    t::check_run_as_accurate(join(r1, single_span(llama, c, half, c.steps, a, b)), ref, exact);
    // The single process for the first half, Ulysses cp2 x pp2 (interleaved, ZeRO 1) for the rest.
    const auto ulysses = plan_of({cp_mode_kind::ulysses, 1, 2, 2, interleaved, false, 1});
    const run_result s1 = single_span(llama, c, 0, half, "", d);
    t::check_run_as_accurate(join(s1, planned_span(llama, c, ulysses, c.steps, d, e)), ref, exact);
  }
}
