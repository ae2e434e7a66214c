// ZeRO 3 (dp_trainer with plan.zero = 3) against the single-process trainer: dp ranks as threads of
// one process (collective/local), each with its own tiny GPT-2 or Llama. The parameters live in
// the ranks' shards and are all-gathered into the model just in time; with poison_released the
// model's buffer is NaN between steps, so a parameter the step did not gather would turn the loss
// into NaN.
#include <catch2/catch.hpp>

#include <cmath>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::models::parallel::dp_options;
using troupe::models::parallel::dp_trainer;

namespace {

void synthetic_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3 + (i * draw) % 5) % 29);
}

train_config tiny_run() {
  train_config c;
  c.steps = 10;
  c.batch = 4;
  c.seq = 8;
  c.grad_accum = 1;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.5;  // the first steps' norms exceed it, so clipping is exercised
  return c;
}

hf::model_config tiny_model(bool llama) {
  return named_model_config(llama ? "llama-tiny" : "gpt2-demo", 29).value();
}

std::vector<float> host_params(causal_lm& m) {
  const tensor& p = m.memory().params();
  return {p.data_as<float>(), p.data_as<float>() + p.numel()};
}

struct run_result {
  std::vector<step_result> steps;
  std::vector<float> params;
  std::int64_t nan_after_step = 0;  // NaN elements of the model's buffer after the last step
  std::int64_t optimizer_elements = 0, total = 0;
};

run_result single_process(bool llama, const train_config& c) {
  auto m = make_causal_lm(tiny_model(llama), {c.batch, c.seq});
  m->init_weights(5);
  trainer t(*m, c);
  run_result r;
  for (int s = 0; s < c.steps; ++s) r.steps.push_back(t.step(synthetic_rows));
  r.params = host_params(*m);
  return r;
}

std::vector<run_result> data_parallel(bool llama, train_config c, int zero, bool poison) {
  const int dp = 2;
  c.plan.dp = dp;
  c.plan.zero = zero;
  auto comms = collective::make_local_group(dp);
  std::vector<run_result> out(dp);
  std::vector<std::exception_ptr> errors(dp);
  std::vector<std::thread> threads;
  for (int r = 0; r < dp; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto m = make_causal_lm(tiny_model(llama), {dp_trainer::microbatch_rows(c), c.seq});
        m->init_weights(5);
        // Odd-sized buckets: many of them, one padded.
        dp_trainer t(*m, c, *comms[r], {.bucket_bytes = 4 * 10007, .poison_released = poison});
        for (int s = 0; s < c.steps; ++s) out[r].steps.push_back(t.step(synthetic_rows));
        for (float x : host_params(*m)) out[r].nan_after_step += std::isnan(x) ? 1 : 0;
        t.gather_full_parameters();
        out[r].params = host_params(*m);
        out[r].optimizer_elements = t.optimizer_elements();
        out[r].total = m->memory().params().numel();
      } catch (...) {
        errors[r] = std::current_exception();
        for (auto& comm : comms) comm->abort("rank " + std::to_string(r) + " failed");
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    d = std::max(d, std::abs(static_cast<double>(a[i]) - b[i]));
  return d;
}

}  // namespace

TEST_CASE("ZeRO 3 data parallel training equals the single process trainer", "[parallel]") {
  const train_config c = tiny_run();
  for (bool llama : {false, true}) {
    INFO((llama ? "llama" : "gpt2"));
    auto ref = single_process(llama, c);
    CHECK(ref.steps[0].grad_norm > c.clip);
    auto zero2 = data_parallel(llama, c, 2, false);
    for (bool poison : {false, true}) {
      INFO("poison_released " << poison);
      auto runs = data_parallel(llama, c, 3, poison);
      for (int s = 0; s < c.steps; ++s) {
        const auto& want = ref.steps[s];
        for (const auto& run : runs) {
          INFO("step " << s);
          const auto& got = run.steps[s];
          CHECK(got.loss == Approx(want.loss).epsilon(1e-4));
          CHECK(got.grad_norm == Approx(want.grad_norm).epsilon(1e-4));
          CHECK(got.lr == want.lr);
        }
      }
      std::int64_t state = 0;
      for (const auto& run : runs) {
        // Released: the whole buffer was NaN after the step (only with the debug option) ...
        CHECK(run.nan_after_step == (poison ? run.total : 0));
        // ... and every rank gathers the same weights, which are ZeRO 2's bit for bit (the same
        // reduce-scattered gradients and the same AdamW on the same chunks) ...
        CHECK(run.params == runs[0].params);
        CHECK(run.params == zero2[0].params);
        CHECK(run.optimizer_elements <= run.total / 2 + 10007);
        state += run.optimizer_elements;
      }
      CHECK(state == runs[0].total);
      // ... and the single process's up to f32 summation order. AdamW magnifies rounding-level
      // gradient differences (see data_parallel.test.cpp), so the bound is not 1e-5 but 3e-5,
      // lr / 100; measured 8.2e-6 (GPT-2) and 1.3e-5 (Llama).
      double diff = max_abs_diff(runs[0].params, ref.params);
      INFO("max abs weight diff " << diff);
      CHECK(diff < 3e-5);
    }
  }
}

TEST_CASE("ZeRO 3 is refused with pipeline parallelism", "[parallel]") {
  train_config c = tiny_run();
  c.plan.dp = 1;
  c.plan.pp = 2;
  c.plan.microbatches = 2;
  c.plan.zero = 3;
  auto comms = collective::make_local_group(1);
  auto m = make_causal_lm(tiny_model(false), {2, c.seq});
  CHECK_THROWS_WITH(dp_trainer(*m, c, *comms[0]), Catch::Contains("parallel.zero = 3"));
}
