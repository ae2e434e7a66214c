// Vectorizable exp and sigmoid for the CPU kernels (internal to tensor/cpu).
//
// exp_fast(float) is the Cephes expf polynomial with the 2^n scale built from exponent bits,
// written without branches or calls so GCC vectorizes any loop that uses it. Over [-87, 88] its
// error is at most 1.01 ulp (checked against double exp over every float in that range); below that
// it returns subnormals and then 0, above ~88.72 it returns inf, and NaN stays NaN.
// exp_fast(double) is std::exp: the f64 path is the reference, not the fast one.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace troupe::cpu {

inline float exp_fast(float x) {
  // Clamp so that n = round(x / ln 2) lies in [-150, 129]; exp(-104) rounds to 0 and exp(89) to
  // inf, so the clamp does not change any result. NaN passes both comparisons unchanged.
  x = x < -104.0f ? -104.0f : x;
  x = x > 89.0f ? 89.0f : x;
  // n = round(x * log2(e)) by the 1.5 * 2^23 trick: the sum's low mantissa bits hold n.
  constexpr float magic = 12582912.0f;
  float t = std::fma(x, 1.44269504088896341f, magic);
  std::int32_t n = std::bit_cast<std::int32_t>(t) - std::bit_cast<std::int32_t>(magic);
  float fn = t - magic;
  // r = x - n ln2 in two steps (Cephes' split of ln 2: 0.693359375 has few bits, so fn * it is
  // exact).
  float r = std::fma(fn, -0.693359375f, x);
  r = std::fma(fn, 2.12194440e-4f, r);
  // exp(r) on |r| <= ln2 / 2.
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.0f;
  // 2^n as two factors so both stay normal floats for every n in [-150, 129]; the products
  // then round to subnormals, zero or inf exactly as the true result would.
  std::int32_t n1 = n >> 1;
  std::int32_t n2 = n - n1;
  float s1 = std::bit_cast<float>((n1 + 127) << 23);
  float s2 = std::bit_cast<float>((n2 + 127) << 23);
  return p * s1 * s2;
}

inline double exp_fast(double x) {
  return std::exp(x);
}

// 1 / (1 + exp(-x)): 0 for very negative x (exp overflows to inf), 1 for very positive x.
template <class T>
inline T sigmoid(T x) {
  return T(1) / (T(1) + exp_fast(-x));
}

}  // namespace troupe::cpu
