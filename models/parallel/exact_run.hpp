// Test helper (included by *.test.cpp only): the f64 twin of a single-process training run, and
// the judge of f32 runs against it (tests/rounding.hpp).
//
// A data-parallel or pipelined run and the single process add the same terms in other orders, so
// their losses, gradient norms and weights differ by f32 rounding, which AdamW magnifies: it
// divides by sqrt(v), so a gradient near zero whose rounding differs moves its weight by up to
// ~lr. How far depends on the CPU's kernels (issue 21: lr / 50 fitted on one machine failed on a
// Zen 4 at 6.46e-5). The f64 run from the same weights is exact for f32 purposes; a run under
// test must be as accurate as the f32 single process is, within tests::default_k of its error.
// Adam's magnification applies to both f32 runs alike, so the ratio stays O(1) on every CPU,
// while a wrong plan (a missing microbatch or reduction, a step applied twice) is off by whole
// lr-sized updates, orders of magnitude beyond.
#pragma once

#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/trainer.hpp"
#include "tensor/tensor.hpp"
#include "tests/rounding.hpp"

namespace troupe::models::testing {

struct exact_run {
  std::vector<double> loss, grad_norm, params;
};

// The single-process trainer in f64 on `model` (a causal_lm built in f64 and initialised like
// the f32 reference: init_weights gives the f32 weights exactly), `c.steps` steps of `rows`.
inline exact_run exact_training(causal_lm& model, train_config c,
                                const trainer::batch_source& rows) {
  REQUIRE(model.memory().params().type() == dtype::f64);
  c.precision = "f64";
  trainer t(model, c);
  exact_run r;
  for (int s = 0; s < c.steps; ++s) {
    const auto st = t.step(rows);
    r.loss.push_back(st.loss);
    r.grad_norm.push_back(st.grad_norm);
  }
  const tensor& p = model.memory().params();
  r.params.assign(p.data_as<double>(), p.data_as<double>() + p.numel());
  return r;
}

// `got` is as accurate as `ref` (an f32 run of the same steps, usually the single process): its
// losses and gradient norms over the steps within tests::trajectory_k, and its final weights (when
// given) within tests::default_k, times ref's own distance from the exact run. Steps: a vector of
// step_result (or anything with .loss and .grad_norm); params: the flat f32 buffer.
template <class Steps>
void check_as_accurate(const Steps& got_steps, const Steps& ref_steps, const exact_run& x,
                       const std::vector<float>* got_params = nullptr,
                       const std::vector<float>* ref_params = nullptr) {
  std::vector<double> gl, rl, gn, rn;
  for (std::size_t s = 0; s < x.loss.size(); ++s) {
    gl.push_back(got_steps.at(s).loss);
    rl.push_back(ref_steps.at(s).loss);
    gn.push_back(got_steps.at(s).grad_norm);
    rn.push_back(ref_steps.at(s).grad_norm);
  }
  const auto vl = tests::as_accurate_as(gl, rl, x.loss, tests::trajectory_k);
  const auto vn = tests::as_accurate_as(gn, rn, x.grad_norm, tests::trajectory_k);
  INFO("losses: " << vl.str());
  INFO("gradient norms: " << vn.str());
  CHECK(vl.ok());
  CHECK(vn.ok());
  double wr = 0;
  if (got_params != nullptr && ref_params != nullptr) {
    const auto vp = tests::as_accurate_as(*got_params, *ref_params, x.params);
    INFO("weights: " << vp.str());
    CHECK(vp.ok());
    wr = vp.ratio();
  }
  if (std::getenv("TROUPE_ROUNDING_REPORT") != nullptr)
    std::printf("rounding ratios: losses %.3g, norms %.3g, weights %.3g\n", vl.ratio(), vn.ratio(),
                wr);
}

// The same for two runs that hold .steps and .params.
template <class Run>
void check_run_as_accurate(const Run& got, const Run& ref, const exact_run& x) {
  check_as_accurate(got.steps, ref.steps, x, &got.params, &ref.params);
}

}  // namespace troupe::models::testing
