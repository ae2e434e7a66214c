// Reduction kernels (see reduce.hpp): AVX2 + F16C bodies, scalar tails with identical rounding.
#include "collective/reduce.hpp"

#include <immintrin.h>

#include <string>

#include "memory/error.hpp"

namespace troupe::collective {

namespace {

// ---- scalar reference, used for the tails -------------------------------------------------------

template <class T>
inline T combine(T a, T b, reduce_op op) {
  return op == reduce_op::max ? (a > b ? a : b) : a + b;
}

inline float widen1(std::uint16_t v, dtype h) {
  return h == dtype::bf16 ? bf16_bits_to_f32(v) : f16_bits_to_f32(v);
}
inline std::uint16_t narrow1(float v, dtype h) {
  return h == dtype::bf16 ? f32_to_bf16_bits(v) : f32_to_f16_bits(v);
}

// ---- AVX2 helpers -------------------------------------------------------------------------------

inline __m256 load_h(const std::uint16_t* p, dtype h) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (h == dtype::f16) return _mm256_cvtph_ps(v);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Round 8 floats to bf16 (nearest even; NaN stays NaN, as f32_to_bf16_bits) or f16 (F16C).
inline void store_h(std::uint16_t* p, __m256 f, dtype h) {
  __m128i out;
  if (h == dtype::f16) {
    out = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
  } else {
    const __m256i u = _mm256_castps_si256(f);
    const __m256i abs = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
    const __m256i is_nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, is_nan);
    out = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
}

// PREFETCHW of the line `write_ahead` bytes past byte `off` of dst (n bytes), once per cache line.
// A line another core has read (a peer of a collective reads what this rank wrote in the last op)
// sits here in shared state: the hardware prefetchers leave a present line alone, so every store
// waited for its invalidation in the store buffer. Asking for ownership ahead made the reduction
// of a 2-rank 1 MiB direct allreduce ~20% faster (collective/README.md). A no-op on CPUs without
// PRFCHW.
constexpr std::size_t write_ahead = 2048;
inline void prefetch_write(const void* dst, std::size_t off, std::size_t n) {
  if ((off & 63) == 0 && off + write_ahead < n)
    asm volatile("prefetchw %0" ::"m"(*(static_cast<const char*>(dst) + off + write_ahead)));
}

inline __m256 combine8(__m256 a, __m256 b, reduce_op op) {
  // maxps(b, a) returns a when a > b, else b: the scalar rule `a > b ? a : b`.
  return op == reduce_op::max ? _mm256_max_ps(b, a) : _mm256_add_ps(a, b);
}

template <class T>
void reduce_same_t(T* dst, const T* a, const T* b, std::size_t n, reduce_op op) {
  std::size_t i = 0;
  const std::size_t bytes = n * sizeof(T);
  if constexpr (sizeof(T) == 4) {
    if (op == reduce_op::max)
      for (; i + 8 <= n; i += 8) {
        prefetch_write(dst, i * 4, bytes);
        _mm256_storeu_ps(dst + i, _mm256_max_ps(_mm256_loadu_ps(b + i), _mm256_loadu_ps(a + i)));
      }
    else
      for (; i + 8 <= n; i += 8) {
        prefetch_write(dst, i * 4, bytes);
        _mm256_storeu_ps(dst + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
      }
  } else {
    if (op == reduce_op::max)
      for (; i + 4 <= n; i += 4) {
        prefetch_write(dst, i * 8, bytes);
        _mm256_storeu_pd(dst + i, _mm256_max_pd(_mm256_loadu_pd(b + i), _mm256_loadu_pd(a + i)));
      }
    else
      for (; i + 4 <= n; i += 4) {
        prefetch_write(dst, i * 8, bytes);
        _mm256_storeu_pd(dst + i, _mm256_add_pd(_mm256_loadu_pd(a + i), _mm256_loadu_pd(b + i)));
      }
  }
  for (; i < n; ++i) dst[i] = combine(a[i], b[i], op);
}

void check_half(dtype h, const char* what) {
  TROUPE_CHECK(h == dtype::bf16 || h == dtype::f16, what, ": expected bf16 or f16, got ",
               dtype_name(h));
}

}  // namespace

void check_reducible(dtype t, const char* what) {
  TROUPE_CHECK(t == dtype::f32 || t == dtype::f64 || t == dtype::bf16 || t == dtype::f16, what,
               ": reductions support f32, f64, bf16 and f16, not ", dtype_name(t));
}

void reduce_same(void* dst, const void* a, const void* b, std::size_t n, dtype t, reduce_op op) {
  if (t == dtype::f32)
    reduce_same_t(static_cast<float*>(dst), static_cast<const float*>(a),
                  static_cast<const float*>(b), n, op);
  else if (t == dtype::f64)
    reduce_same_t(static_cast<double*>(dst), static_cast<const double*>(a),
                  static_cast<const double*>(b), n, op);
  else
    TROUPE_FAIL("reduce_same: expected f32 or f64, got ", dtype_name(t));
}

void reduce_widen(float* dst, const float* a, const std::uint16_t* b, std::size_t n, dtype h,
                  reduce_op op) {
  check_half(h, "reduce_widen");
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    prefetch_write(dst, i * 4, n * 4);
    _mm256_storeu_ps(dst + i, combine8(_mm256_loadu_ps(a + i), load_h(b + i, h), op));
  }
  for (; i < n; ++i) dst[i] = combine(a[i], widen1(b[i], h), op);
}

void reduce_narrow(std::uint16_t* dst, const float* a, const std::uint16_t* b, std::size_t n,
                   dtype h, reduce_op op, float divisor) {
  check_half(h, "reduce_narrow");
  std::size_t i = 0;
  if (divisor == 1.0f) {
    for (; i + 8 <= n; i += 8) {
      prefetch_write(dst, i * 2, n * 2);
      store_h(dst + i, combine8(_mm256_loadu_ps(a + i), load_h(b + i, h), op), h);
    }
    for (; i < n; ++i) dst[i] = narrow1(combine(a[i], widen1(b[i], h), op), h);
  } else {
    const __m256 d = _mm256_set1_ps(divisor);
    for (; i + 8 <= n; i += 8) {
      prefetch_write(dst, i * 2, n * 2);
      store_h(dst + i, _mm256_div_ps(combine8(_mm256_loadu_ps(a + i), load_h(b + i, h), op), d), h);
    }
    for (; i < n; ++i) dst[i] = narrow1(combine(a[i], widen1(b[i], h), op) / divisor, h);
  }
}

void widen(float* dst, const std::uint16_t* src, std::size_t n, dtype h) {
  check_half(h, "widen");
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_h(src + i, h));
  for (; i < n; ++i) dst[i] = widen1(src[i], h);
}

void narrow(std::uint16_t* dst, const float* src, std::size_t n, dtype h, float divisor) {
  check_half(h, "narrow");
  std::size_t i = 0;
  if (divisor == 1.0f) {
    for (; i + 8 <= n; i += 8) store_h(dst + i, _mm256_loadu_ps(src + i), h);
    for (; i < n; ++i) dst[i] = narrow1(src[i], h);
  } else {
    const __m256 d = _mm256_set1_ps(divisor);
    for (; i + 8 <= n; i += 8) store_h(dst + i, _mm256_div_ps(_mm256_loadu_ps(src + i), d), h);
    for (; i < n; ++i) dst[i] = narrow1(src[i] / divisor, h);
  }
}

void divide(void* data, std::size_t n, dtype t, double divisor) {
  std::size_t i = 0;
  if (t == dtype::f32) {
    float* p = static_cast<float*>(data);
    const float df = static_cast<float>(divisor);
    const __m256 d = _mm256_set1_ps(df);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(p + i, _mm256_div_ps(_mm256_loadu_ps(p + i), d));
    for (; i < n; ++i) p[i] = p[i] / df;
  } else if (t == dtype::f64) {
    double* p = static_cast<double*>(data);
    const __m256d d = _mm256_set1_pd(divisor);
    for (; i + 4 <= n; i += 4) _mm256_storeu_pd(p + i, _mm256_div_pd(_mm256_loadu_pd(p + i), d));
    for (; i < n; ++i) p[i] = p[i] / divisor;
  } else {
    TROUPE_FAIL("divide: expected f32 or f64, got ", dtype_name(t));
  }
}

}  // namespace troupe::collective
