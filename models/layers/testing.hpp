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

// max |a - b| / max(|b|, floor) over elements.
inline double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b,
                           double floor = 1e-3) {
  REQUIRE(a.size() == b.size());
  double m = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    m = std::max(m, std::abs(a[i] - b[i]) / std::max(std::abs(b[i]), floor));
  return m;
}

// Compares analytic[i] with the central difference (loss(p_i + h) - loss(p_i - h)) / 2h for every
// element of p, or for `max_elems` random ones when p is larger. The error bound per element is
// rel * max(|fd|, |analytic|) + abs: rounding in a loss of magnitude ~1-10 computed in f64 is
// ~1e-15, divided by 2h = 2e-6 gives ~1e-9, well under abs = 1e-8; truncation is O(h^2) ~ 1e-12.
struct gradcheck_options {
  double h = 1e-6;
  double rel = 1e-6;
  double abs = 1e-8;
  int max_elems = 40;
};

inline void check_gradient(const std::string& what, const tensor& p,
                           const std::vector<double>& analytic, const std::function<double()>& loss,
                           rng& g, const gradcheck_options& o = {}) {
  REQUIRE(static_cast<std::int64_t>(analytic.size()) == p.numel());
  double* x = ptr(p);
  std::vector<std::int64_t> idx(p.numel());
  std::iota(idx.begin(), idx.end(), 0);
  if (p.numel() > o.max_elems) {
    std::shuffle(idx.begin(), idx.end(), g.gen);
    idx.resize(o.max_elems);
  }
  int failures = 0;
  double worst = 0, worst_fd = 0, worst_an = 0;
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
    double bound = o.rel * std::max(std::abs(fd), std::abs(an)) + o.abs;
    norm += fd * fd;
    if (err > bound) ++failures;
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
            << " (error / bound = " << worst << ")");
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
// activation gradient `dx` (when given) is overwritten, not accumulated.
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
