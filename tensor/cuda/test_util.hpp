// Helpers for the CUDA backend tests: random host tensors, moves between host and device, 16-bit
// rounding on the host, and an elementwise comparison that reports the first mismatches.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "memory/gpu.hpp"
#include "tensor/ops.hpp"
#include "tensor/tensor.hpp"

// Every [gpu] test starts with this: without a GPU it prints the skip marker CTest looks for.
#define TROUPE_NEED_GPU()                   \
  do {                                      \
    if (!troupe::memory::gpu_available()) { \
      WARN("troupe-skip: no GPU");          \
      return;                               \
    }                                       \
  } while (0)

namespace troupe::cuda_test {

// Uniform values in [lo, hi) on the host (f32).
inline owned_tensor random(const shape& s, std::uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  owned_tensor t = empty(s, dtype::f32);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  float* p = t.data_as<float>();
  for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = u(gen);
  return t;
}

inline owned_tensor gpu(const tensor& t) {
  return to_device(t, device::cuda());
}
inline owned_tensor host(const tensor& t) {
  return to_device(t, device::cpu());
}

// The values of a contiguous tensor (on any device) as doubles.
inline std::vector<double> values(const tensor& t) {
  owned_tensor h = host(t);
  std::vector<double> v(static_cast<std::size_t>(h.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) {
    const void* p = static_cast<const char*>(h.data()) + i * h.element_size();
    switch (h.type()) {
      case dtype::f32:
        v[i] = *static_cast<const float*>(p);
        break;
      case dtype::f64:
        v[i] = *static_cast<const double*>(p);
        break;
      case dtype::bf16:
        v[i] = bf16_bits_to_f32(*static_cast<const std::uint16_t*>(p));
        break;
      case dtype::f16:
        v[i] = f16_bits_to_f32(*static_cast<const std::uint16_t*>(p));
        break;
      case dtype::i32:
        v[i] = *static_cast<const std::int32_t*>(p);
        break;
      case dtype::i64:
        v[i] = static_cast<double>(*static_cast<const std::int64_t*>(p));
        break;
      case dtype::u8:
        v[i] = *static_cast<const std::uint8_t*>(p);
        break;
    }
  }
  return v;
}

// A host tensor of dtype t (bf16 or f16) holding the f32 host tensor x rounded to nearest even.
inline owned_tensor to_16bit(const tensor& x, dtype t) {
  owned_tensor out = empty(x.sizes(), t);
  const float* src = x.data_as<float>();
  auto* dst = static_cast<std::uint16_t*>(out.data());
  for (std::int64_t i = 0; i < x.numel(); ++i)
    dst[i] = t == dtype::bf16 ? f32_to_bf16_bits(src[i]) : f32_to_f16_bits(src[i]);
  return out;
}
// The f32 host tensor x with every value rounded through dtype t.
inline owned_tensor rounded(const tensor& x, dtype t) {
  owned_tensor out = empty(x.sizes(), dtype::f32);
  const float* src = x.data_as<float>();
  float* dst = out.data_as<float>();
  for (std::int64_t i = 0; i < x.numel(); ++i)
    dst[i] = t == dtype::bf16 ? bf16_bits_to_f32(f32_to_bf16_bits(src[i]))
                              : f16_bits_to_f32(f32_to_f16_bits(src[i]));
  return out;
}
// The relative spacing of 16-bit values: one unit in the last place is at most this times |x|.
inline double ulp16(dtype t) {
  return t == dtype::bf16 ? 0x1p-7 : 0x1p-10;
}

// Every element of got within abs + rel * |want| of want (same numel; any devices and dtypes).
inline void require_close(const tensor& got, const tensor& want, double rel, double abs,
                          const char* what) {
  std::vector<double> g = values(got), w = values(want);
  REQUIRE(g.size() == w.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    bool same_nonfinite =
        !std::isfinite(w[i]) && (std::isnan(w[i]) ? std::isnan(g[i]) : g[i] == w[i]);
    if (same_nonfinite || std::abs(g[i] - w[i]) <= abs + rel * std::abs(w[i])) continue;
    if (bad < 5) UNSCOPED_INFO(what << "[" << i << "]: got " << g[i] << ", want " << w[i]);
    ++bad;
  }
  INFO(what << ": " << bad << " of " << g.size() << " elements differ");
  REQUIRE(bad == 0);
}

// Every element of got within its own bound of want: |got[i] - want[i]| <= bound[i].
inline void require_within(const tensor& got, const tensor& want, const std::vector<double>& bound,
                           const char* what) {
  std::vector<double> g = values(got), w = values(want);
  REQUIRE(g.size() == w.size());
  REQUIRE(bound.size() == w.size());
  std::size_t bad = 0;
  for (std::size_t i = 0; i < g.size(); ++i) {
    if (std::abs(g[i] - w[i]) <= bound[i]) continue;  // NaN fails
    if (bad < 5)
      UNSCOPED_INFO(what << "[" << i << "]: got " << g[i] << ", want " << w[i] << " +- "
                         << bound[i]);
    ++bad;
  }
  INFO(what << ": " << bad << " of " << g.size() << " elements differ");
  REQUIRE(bad == 0);
}

// f32's unit roundoff, and the bound on |computed - exact| of a dot product of k terms in any
// order, scaled and added to a scaled old value: (k + 2) u (|alpha| sum |a b| + |beta c0|). Two
// such computations (the device and the host, each with its own order) differ by twice that.
inline constexpr double u32 = 0x1p-24;

// |alpha| |a| @ |b| + |beta| |c0| in double for host f32 [m, k] and [k, n] views (any strides) and
// a contiguous [m, n] c0: the mag of each element of alpha a @ b + beta c0.
inline std::vector<double> gemm_magnitudes(const tensor& a, const tensor& b, const tensor& c0,
                                           double alpha, double beta) {
  const std::int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  auto at = [](const tensor& x, std::int64_t r, std::int64_t c) {
    return static_cast<double>(x.data_as<float>()[r * x.stride(0) + c * x.stride(1)]);
  };
  std::vector<double> mag(static_cast<std::size_t>(m * n));
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      double s = 0;
      for (std::int64_t l = 0; l < k; ++l) s += std::abs(at(a, i, l) * at(b, l, j));
      mag[i * n + j] = std::abs(alpha) * s + std::abs(beta * at(c0, i, j));
    }
  return mag;
}

}  // namespace troupe::cuda_test
