// Test helpers for the CPU kernel tests (included by tensor/cpu/*.test.cpp only): host buffers
// filled with seeded random values, tensors over them, and element-by-element comparison against
// double-precision reference values with a tolerance |got - ref| <= atol + rtol * |ref|.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::cpu::testing {

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

// A host buffer of n values of T with a contiguous tensor view over it.
template <class T>
struct buffer {
  std::vector<T> v;
  tensor t;
  explicit buffer(const shape& s, T init = T{})
      : v(static_cast<std::size_t>(std::max<std::int64_t>(s.numel(), 1)), init),
        t(v.data(), v.size() * sizeof(T), dtype_of<T>, s) {}
  buffer(const buffer&) = delete;
  T& operator[](std::int64_t i) { return v[static_cast<std::size_t>(i)]; }
  T operator[](std::int64_t i) const { return v[static_cast<std::size_t>(i)]; }
  std::int64_t size() const { return t.numel(); }
  operator const tensor&() const { return t; }
};

template <class T>
void fill_uniform(buffer<T>& b, rng& g, double lo, double hi) {
  for (std::int64_t i = 0; i < b.size(); ++i) b[i] = static_cast<T>(g.uniform(lo, hi));
}

// Unit roundoff of T: the tolerances below are multiples of it.
template <class T>
inline constexpr double eps_of = std::is_same_v<T, float> ? 0x1p-24 : 0x1p-53;

// Every element within atol + rtol * |ref|; reports the first element that is not.
template <class T>
void require_close(const buffer<T>& got, const std::vector<double>& ref, double rtol, double atol) {
  REQUIRE(static_cast<std::size_t>(got.size()) == ref.size());
  std::int64_t bad = -1;
  double worst = 0;
  for (std::int64_t i = 0; i < got.size(); ++i) {
    double g = static_cast<double>(got[i]), r = ref[static_cast<std::size_t>(i)];
    double err = std::fabs(g - r);
    bool ok = err <= atol + rtol * std::fabs(r) || (std::isnan(g) && std::isnan(r)) ||
              (std::isinf(g) && g == r);
    if (!ok && bad < 0) bad = i;
    if (std::isfinite(err)) worst = std::max(worst, err / (atol + rtol * std::fabs(r)));
  }
  INFO("worst error / tolerance = " << worst);
  if (bad >= 0) {
    INFO("element " << bad << ": got " << static_cast<double>(got[bad]) << ", expected "
                    << ref[static_cast<std::size_t>(bad)]);
    REQUIRE(bad < 0);
  }
}

// Every element within its own bound: |got[i] - ref[i]| <= bound[i].
template <class T>
void require_within(const buffer<T>& got, const std::vector<double>& ref,
                    const std::vector<double>& bound) {
  REQUIRE(static_cast<std::size_t>(got.size()) == ref.size());
  for (std::int64_t i = 0; i < got.size(); ++i) {
    const auto k = static_cast<std::size_t>(i);
    if (std::fabs(static_cast<double>(got[i]) - ref[k]) <= bound[k]) continue;
    INFO("element " << i << ": got " << static_cast<double>(got[i]) << ", expected " << ref[k]
                    << " +- " << bound[k]);
    REQUIRE(std::fabs(static_cast<double>(got[i]) - ref[k]) <= bound[k]);
  }
}

// Relative difference of two scalars, for totals.
inline double rel_diff(double a, double b) {
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-300);
}

}  // namespace troupe::cpu::testing
