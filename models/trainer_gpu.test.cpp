// The single-process trainer on a GPU: the same model, batches and steps as on the CPU, with every
// tensor on the device (models/trainer.cpp uploads each batch's ids and targets; the kernels are
// tensor/cuda's). Judged by the rule of tests/rounding.hpp: the GPU run and the CPU run are both
// compared with the exact-arithmetic (f64, CPU) twin from the same starting weights, and the GPU
// run must be as accurate as the CPU run, within k times the CPU run's own error. The two runs
// share no kernel (cuBLAS against OpenBLAS, the device's reductions and attention against the
// CPU's), so their roundings differ but are of one size; a wrong kernel (a missed term, a wrong
// scale, a stale buffer) is off by O(1) in the loss or an lr-sized step in the weights.
//
// f32: each step's loss and gradient norm within tests::trajectory_k, the final weights within
// tests::default_k (the reasons are in tests/rounding.hpp). bf16 (f32 master weights, gradients
// and moments): as the bf16 plans (models/parallel/mixed_plans.test.cpp), default_k for the
// trajectory too: every activation is rounded to 8 bits in both runs, and those roundings set both
// runs' errors, so their ratio is O(1).
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "memory/gpu.hpp"
#include "models/causal_lm.hpp"
#include "models/parallel/exact_run.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

void rows_of(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3) % 64);
}

hf::model_config model_of(bool llama) {
  return named_model_config(llama ? "llama-tiny" : "gpt2-demo", 64).value();
}

train_config run_of(const std::string& precision) {
  train_config c;
  c.steps = 6;
  c.batch = 4;
  c.seq = 16;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.5;  // the first steps' norms exceed it: clipping runs on the device
  c.eps = 1e-6;  // as the bf16 plans: AdamW does not magnify rounding noise to ~lr
  c.precision = precision;
  c.seed = 5;
  return c;
}

// Any tensor (any device, f32 / bf16 / f64) as f64 values on the host.
std::vector<double> host_f64(const tensor& t) {
  const owned_tensor h = to_device(t, device::cpu());
  owned_tensor d = empty(h.sizes(), dtype::f64);
  ops::copy(h, d);
  return {d.data_as<double>(), d.data_as<double>() + d.numel()};
}

struct run_result {
  std::vector<step_result> steps;
  std::vector<double> weights;  // the final master weights
};

// c.steps steps of the trainer on a model of type t on dev, from the weights `start` (on the CPU,
// of type t).
run_result train_on(bool llama, const train_config& c, dtype t, device dev, const tensor& start) {
  auto m = make_causal_lm(model_of(llama), {c.batch, c.seq}, t, dev);
  REQUIRE(m->memory().params().dev() == dev);
  ops::copy(to_device(start, dev), m->memory().params());
  trainer tr(*m, c);
  run_result r;
  for (int s = 0; s < c.steps; ++s) r.steps.push_back(tr.step(rows_of));
  r.weights = host_f64(tr.master_weights());
  return r;
}

}  // namespace

TEST_CASE("The trainer on a GPU trains as accurately as on the CPU in f32 and bf16", "[gpu]") {
  if (!memory::gpu_available()) {
    WARN("troupe-skip: no GPU");
    return;
  }
  for (const std::string precision : {"f32", "bf16"}) {
    for (bool llama : {false, true}) {
      INFO((llama ? "llama-tiny " : "gpt2-demo ") << precision);
      const train_config c = run_of(precision);
      const dtype t = precision == "bf16" ? dtype::bf16 : dtype::f32;
      auto start = make_causal_lm(model_of(llama), {c.batch, c.seq}, t);
      start->init_weights(c.seed);
      auto x = make_causal_lm(model_of(llama), {c.batch, c.seq}, dtype::f64);
      ops::copy(start->memory().params(), x->memory().params());  // same slots, same layout
      // Progress on stderr: a run that stops somewhere says where.
      const char* name = llama ? "llama-tiny" : "gpt2-demo";
      std::fprintf(stderr, "%s %s: the exact run\n", name, precision.c_str());
      const auto exact = testing::exact_training(*x, c, rows_of);
      std::fprintf(stderr, "%s %s: the CPU run\n", name, precision.c_str());
      const run_result cpu = train_on(llama, c, t, device::cpu(), start->memory().params());
      std::fprintf(stderr, "%s %s: the GPU run\n", name, precision.c_str());
      const run_result gpu = train_on(llama, c, t, device::cuda(), start->memory().params());

      std::vector<double> gl, rl, gn, rn;
      for (int s = 0; s < c.steps; ++s) {
        gl.push_back(gpu.steps[s].loss);
        rl.push_back(cpu.steps[s].loss);
        gn.push_back(gpu.steps[s].grad_norm);
        rn.push_back(cpu.steps[s].grad_norm);
      }
      const double k = t == dtype::bf16 ? tests::default_k : tests::trajectory_k;
      const auto vl = tests::as_accurate_as(gl, rl, exact.loss, k);
      const auto vn = tests::as_accurate_as(gn, rn, exact.grad_norm, k);
      const auto vw = tests::as_accurate_as(gpu.weights, cpu.weights, exact.params);
      INFO("losses: " << vl.str());
      INFO("gradient norms: " << vn.str());
      INFO("weights: " << vw.str());
      CHECK(vl.ok());
      CHECK(vn.ok());
      CHECK(vw.ok());
      // Both runs trained: the loss fell, and the weights moved by lr-sized steps.
      CHECK(gpu.steps.back().loss < gpu.steps.front().loss);
      std::printf(
          "trainer on GPU, %s %s: loss %.5f -> %.5f (CPU %.5f -> %.5f); ratios to the "
          "CPU's error: losses %.3g, norms %.3g, weights %.3g\n",
          llama ? "llama-tiny" : "gpt2-demo", precision.c_str(), gpu.steps.front().loss,
          gpu.steps.back().loss, cpu.steps.front().loss, cpu.steps.back().loss, vl.ratio(),
          vn.ratio(), vw.ratio());
    }
  }
}
