// Test helpers for layers (included by the *.test.cpp files only): random f64 tensors, plain
// loops independent of the kernels under test, and central finite-difference gradient checks.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "models/layers/linear.hpp"
#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::testing {

struct rng {
  std::mt19937_64 gen;
  explicit rng(std::uint64_t seed) : gen(seed) {}
  double uniform(double lo, double hi) {
    return std::uniform_real_distribution<double>(lo, hi)(gen);
  }
  std::int64_t integer(std::int64_t lo, std::int64_t hi) {  // in [lo, hi]
    return std::uniform_int_distribution<std::int64_t>(lo, hi)(gen);
  }
};

// Plain access to contiguous host tensors (no kernels involved).
template <class T = double>
T* ptr(const tensor& t) {
  REQUIRE(t.is_cpu());
  REQUIRE(t.is_contiguous());
  return t.data_as<T>();
}

inline owned_tensor host_zeros(const shape& s, dtype t = dtype::f64) {
  auto x = empty(s, t);
  if (x.nbytes() > 0) std::memset(x.data(), 0, x.nbytes());
  return x;
}

inline void fill_uniform(const tensor& t, rng& g, double scale = 1.0) {
  double* p = ptr(t);
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = g.uniform(-scale, scale);
}

inline owned_tensor random_tensor(const shape& s, rng& g, double scale = 1.0) {
  auto x = host_zeros(s);
  fill_uniform(x, g, scale);
  return x;
}

inline std::vector<double> values(const tensor& t) {
  const double* p = ptr(t);
  return std::vector<double>(p, p + t.numel());
}

inline double dot(const tensor& a, const tensor& b) {
  REQUIRE(a.numel() == b.numel());
  const double* x = ptr(a);
  const double* y = ptr(b);
  double s = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) s += x[i] * y[i];
  return s;
}

// A plain reference for a bound linear: y[n, o] = sum_i x[n, i] w[o, i] + b[o].
inline std::vector<double> linear_ref(const std::vector<double>& x, std::int64_t n,
                                      const linear& l) {
  const double* w = ptr(l.weight);
  std::vector<double> y(n * l.cfg.out);
  for (std::int64_t r = 0; r < n; ++r)
    for (std::int64_t o = 0; o < l.cfg.out; ++o) {
      double s = l.cfg.bias ? ptr(l.bias)[o] : 0.0;
      for (std::int64_t i = 0; i < l.cfg.in; ++i) s += x[r * l.cfg.in + i] * w[o * l.cfg.in + i];
      y[r * l.cfg.out + o] = s;
    }
  return y;
}

// Every parameter of the list: uniform in [-scale, scale].
inline void randomize_params(const slot_list& s, rng& g, double scale = 0.5) {
  for (const auto& slot : s.slots())
    if (slot.kind == slot_kind::param) fill_uniform(*slot.field, g, scale);
}

// max |a - b| / max(|b|, floor) over elements. For the f64 forwards against plain loops: a sum of
// K <= 16 terms of O(1) rounds to <= K u sum|terms| ~ 1e-14 (u = 2^-53) in any order, so the
// relative difference with floor 1e-3 is ~1e-11 in the worst case and ~1e-14 in practice
// (measured <= 8e-14); 1e-12 (1e-11 for attention's longer chain) catches any wrong term.
inline double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b,
                           double floor = 1e-3) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(a[i] - b[i]) / std::max(std::abs(b[i]), floor));
  return m;
}

// Compares analytic[i] with the central difference fd = (loss(p_i + h) - loss(p_i - h)) / 2h for
// every element of p, or for `max_elems` random ones when p is larger; p and the loss are f64. The
// central difference errs in two ways, and the bound per element is their sum:
// - truncation, f'''(x) h^2 / 6: relative to the gradient, (h / l)^2 / 6 for a loss that bends on
//   a length l in this parameter. Inputs and weights of O(1) through tanh, exp, 1 / sqrt and
//   products bend on l ~ 0.1 to 1, giving 2e-12 to 2e-11 at h = 1e-6; rel = 1e-6 is met down to
//   l = 4e-4 (a gradient off by a mistake is off by O(1), 1e6 times more);
// - rounding: each of the two losses carries f64 rounding, at most `roundings` units u = 2^-53 of
//   the loss's scale max(1, |loss|) (the terms of these small losses are O(1)); the difference of
//   the two divided by 2h gives roundings * u * scale / h, 7e-9 for a loss of 1 at the defaults.
//   64 roundings is 6 times the largest error measured in these tests (10, truncation included)
//   and stays far below any O(1) mistake.
struct gradcheck_options {
  double h = 1e-6;
  double rel = 1e-6;
  double roundings = 64;
  int max_elems = 40;
};

inline void check_gradient(const std::string& what, const tensor& p,
                           const std::vector<double>& analytic, const std::function<double()>& loss,
                           rng& g, const gradcheck_options& o = {}) {
  REQUIRE(p.type() == dtype::f64);  // the rounding term is derived for f64 losses
  REQUIRE(static_cast<std::int64_t>(analytic.size()) == p.numel());
  constexpr double u = 1.0 / 9007199254740992.0;  // 2^-53
  double* x = ptr(p);
  std::vector<std::int64_t> idx(p.numel());
  std::iota(idx.begin(), idx.end(), 0);
  if (p.numel() > o.max_elems) {
    std::shuffle(idx.begin(), idx.end(), g.gen);
    idx.resize(o.max_elems);
  }
  const double rounding = o.roundings * u * std::max(1.0, std::abs(loss())) / o.h;
  int failures = 0;
  double worst = 0, worst_fd = 0, worst_an = 0, noise = 0;
  std::int64_t worst_i = -1;
  double norm = 0;
  for (std::int64_t i : idx) {
    double keep = x[i];
    x[i] = keep + o.h;
    double lp = loss();
    x[i] = keep - o.h;
    double lm = loss();
    x[i] = keep;
    double fd = (lp - lm) / (2 * o.h);
    double an = analytic[i];
    double err = std::abs(fd - an);
    double bound = o.rel * std::max(std::abs(fd), std::abs(an)) + rounding;
    norm += fd * fd;
    if (err > bound) ++failures;
    noise = std::max(noise, err / rounding * o.roundings);
    if (err / bound > worst) {
      worst = err / bound;
      worst_fd = fd;
      worst_an = an;
      worst_i = i;
    }
  }
  loss();  // leave the layer's saved state as at the unperturbed point
  INFO(what << ": " << failures << " of " << idx.size() << " elements off; worst element "
            << worst_i << ": finite difference " << worst_fd << ", analytic " << worst_an
            << " (error / bound = " << worst << "); largest error " << noise
            << " roundings of the loss");
  CHECK(failures == 0);
  CHECK(norm > 0);  // a gradient that is zero everywhere proves nothing
}

// Checks every parameter gradient of a slot list (the grads must hold one backward's result).
inline void check_param_gradients(const slot_list& s, const std::function<double()>& loss, rng& g,
                                  const gradcheck_options& o = {}) {
  std::vector<std::pair<const tensor_slot*, std::vector<double>>> snap;
  for (const auto& slot : s.slots())
    if (slot.kind == slot_kind::param) snap.emplace_back(&slot, values(*slot.grad));
  for (auto& [slot, an] : snap) check_gradient(slot->name, *slot->field, an, loss, g, o);
}

// Parameter gradients accumulate: a second backward (without a new forward) doubles them, and the
// activation gradient `dx` (when given) is overwritten, not accumulated. In f64: the second
// backward adds the same products again; where a GEMM's inner dimension fits one block (these
// sizes) that is R + R = 2R exactly, and dx is the same computation on the same inputs (both
// measured equal bit for bit on AVX2 and AVX-512 kernels, 1 and 2 threads). A kernel that adds into
// C block by block along K rounds once more per block, <= K u sum|terms| ~ 1e-14 of the scale for K
// <= 24; 1e-12 allows that, while a backward that overwrites or adds twice is off by the whole
// scale.
inline void check_accumulation(const layer_memory& mem, const std::function<void()>& backward,
                               const tensor& dx = {}) {
  mem.zero_grads();
  backward();
  std::vector<double> once = values(mem.grads());
  std::vector<double> dx_once = dx.defined() ? values(dx) : std::vector<double>{};
  backward();
  std::vector<double> twice = values(mem.grads());
  double scale = 0;
  for (double v : once) scale = std::max(scale, std::abs(v));
  REQUIRE(scale > 0);
  double worst = 0;
  for (std::size_t i = 0; i < once.size(); ++i)
    worst = std::max(worst, std::abs(twice[i] - 2 * once[i]) / scale);
  CHECK(worst <= 1e-12);
  if (dx.defined()) CHECK(max_rel_diff(values(dx), dx_once) <= 1e-12);
}

}  // namespace troupe::models::testing
