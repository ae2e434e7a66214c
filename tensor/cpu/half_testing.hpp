// Test helpers for the bf16 and f16 paths of the CPU kernels (included by tensor/cpu/*.test.cpp
// only). A 16-bit op is checked against the f32 op run on the same rounded inputs: `twin` holds a
// 16-bit buffer and an f32 buffer with exactly the same values, and require_ulps compares a 16-bit
// result with the f32 one in units of the 16-bit spacing (ulp) at the f32 value. A kernel that
// computes in f32 and rounds once lands within half an ulp; one that rounds intermediates, or
// rounds the wrong way, does not.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "tensor/cpu/testing.hpp"
#include "tensor/dtype.hpp"

namespace troupe::cpu::testing {

// The value of a 16-bit element, through the scalar converters of tensor/dtype.hpp (independent of
// the kernels' converters in half.hpp).
inline double value_of(bf16_t v) {
  return bf16_bits_to_f32(v.bits);
}
inline double value_of(f16_t v) {
  return f16_bits_to_f32(v.bits);
}
inline double value_of(float v) {
  return v;
}
inline double value_of(double v) {
  return v;
}
template <class S>
S round_to(double v) {
  if constexpr (std::is_same_v<S, bf16_t>) {
    return {f32_to_bf16_bits(static_cast<float>(v))};
  } else {
    return {f32_to_f16_bits(static_cast<float>(v))};
  }
}

// Spacing of S's numbers at |x| (bf16: 8 significant bits, f16: 11; both with subnormals).
template <class S>
double ulp_of(double x) {
  constexpr int digits = std::is_same_v<S, bf16_t> ? 8 : 11;
  constexpr int min_exp = std::is_same_v<S, bf16_t> ? -126 : -14;
  int e = 0;
  std::frexp(std::fabs(x), &e);  // |x| in [2^(e-1), 2^e)
  return std::ldexp(1.0, std::max(e - 1, min_exp) - (digits - 1));
}

// A 16-bit buffer and an f32 buffer of the same shape holding the same values.
template <class S>
struct twin {
  buffer<S> h;
  buffer<float> f;
  explicit twin(const shape& s) : h(s), f(s) {}
  twin(const twin&) = delete;
  std::int64_t size() const { return h.size(); }
  void set(std::int64_t i, double v) {
    h[i] = round_to<S>(v);
    f[i] = static_cast<float>(value_of(h[i]));
  }
  void uniform(rng& g, double lo, double hi) {
    for (std::int64_t i = 0; i < size(); ++i) set(i, g.uniform(lo, hi));
  }
  // f = the values of h (after an op wrote h).
  void sync() {
    for (std::int64_t i = 0; i < size(); ++i) f[i] = static_cast<float>(value_of(h[i]));
  }
};

// Every got[i] within ulps * ulp_of(ref[i]) + atol of the f32 result ref[i] (NaNs and infinities
// must match).
template <class S, class R>
void require_ulps(const buffer<S>& got, const buffer<R>& ref, double ulps, double atol = 0) {
  REQUIRE(got.size() == ref.size());
  std::int64_t bad = -1;
  double worst = 0;
  for (std::int64_t i = 0; i < got.size(); ++i) {
    const double g = value_of(got[i]), r = value_of(ref[i]);
    const double tol = ulps * ulp_of<S>(r) + atol;
    const bool ok =
        std::fabs(g - r) <= tol || (std::isnan(g) && std::isnan(r)) || (std::isinf(g) && g == r);
    if (!ok && bad < 0) bad = i;
    if (std::isfinite(g - r)) worst = std::max(worst, std::fabs(g - r) / tol);
  }
  INFO("worst error / tolerance = " << worst);
  if (bad >= 0) {
    INFO("element " << bad << ": got " << value_of(got[bad]) << ", f32 op gives "
                    << value_of(ref[bad]) << " (ulp " << ulp_of<S>(value_of(ref[bad])) << ")");
    REQUIRE(bad < 0);
  }
}

// Every got[i] equal to want[i] bit for bit.
template <class S>
void require_same_bits(const buffer<S>& got, const buffer<S>& want) {
  REQUIRE(got.size() == want.size());
  for (std::int64_t i = 0; i < got.size(); ++i) {
    if (got[i].bits == want[i].bits) continue;
    INFO("element " << i << ": got " << value_of(got[i]) << ", expected " << value_of(want[i]));
    REQUIRE(got[i].bits == want[i].bits);
  }
}

}  // namespace troupe::cpu::testing
