// 16-bit floating storage in the CPU kernels (internal to tensor/cpu): bf16 and f16 tensors are
// loaded to f32, computed in f32 and rounded once to nearest even on the way out, like torch
// autocast and the CUDA kernels.
//
// compute_t<S> is the type an element of storage type S is computed in (float for bf16 and f16,
// S itself for f32 and f64). The scalar converters are branch-free so that GCC vectorizes loops
// that use them: bf16 is the top half of an f32 (a shift up; rounding adds 0x7fff plus the lowest
// kept bit), f16 goes through F16C. The span converters widen_n / narrow_n do runs of elements with
// AVX2 + F16C. Both round exactly like the converters of tensor/dtype.hpp (NaN payloads aside).
//
// map_elements runs an elementwise body over whole tensors: directly for f32 and f64, and for
// 16-bit tensors a block at a time through f32 stack arrays, so the body is the same f32 code.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <utility>

#include "tensor/dtype.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {

template <class S>
inline constexpr bool is_half = std::is_same_v<S, bf16_t> || std::is_same_v<S, f16_t>;

template <class S>
using compute_t = std::conditional_t<is_half<S>, float, S>;

// ---- scalars
// -------------------------------------------------------------------------------------

inline float bf16_to_float(std::uint16_t h) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16);
}
// Round to nearest even; NaN stays a (quiet) NaN. Same result as f32_to_bf16_bits.
inline std::uint16_t float_to_bf16(float f) {
  const std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  const std::uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const std::uint32_t nan = (u >> 16) | 0x40u;
  return static_cast<std::uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : r);
}

// The value of one stored element in its compute type.
template <class S>
inline compute_t<S> to_compute(S v) {
  if constexpr (std::is_same_v<S, bf16_t>) {
    return bf16_to_float(v.bits);
  } else if constexpr (std::is_same_v<S, f16_t>) {
    return _cvtsh_ss(v.bits);
  } else {
    return v;
  }
}

// A compute value rounded to storage type S.
template <class S>
inline S from_compute(compute_t<S> v) {
  if constexpr (std::is_same_v<S, bf16_t>) {
    return {float_to_bf16(v)};
  } else if constexpr (std::is_same_v<S, f16_t>) {
    return {static_cast<std::uint16_t>(_cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT))};
  } else {
    return v;
  }
}

// ---- runs
// ----------------------------------------------------------------------------------------

// d[0, n) = s[0, n) in f32.
template <class S>
inline void widen_n(const S* s, float* d, std::int64_t n) {
  std::int64_t i = 0;
  if constexpr (std::is_same_v<S, f16_t>) {
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(d + i,
                       _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i))));
  } else if constexpr (std::is_same_v<S, bf16_t>) {
    for (; i + 8 <= n; i += 8) {
      const __m256i w =
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_ps(d + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
  for (; i < n; ++i) d[i] = static_cast<float>(to_compute(s[i]));
}

// d[0, n) = s[0, n) rounded to S.
template <class S>
inline void narrow_n(const float* s, S* d, std::int64_t n) {
  std::int64_t i = 0;
  if constexpr (std::is_same_v<S, f16_t>) {
    for (; i + 8 <= n; i += 8)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                       _mm256_cvtps_ph(_mm256_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT));
  } else if constexpr (std::is_same_v<S, bf16_t>) {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
    const __m256i bias = _mm256_set1_epi32(0x7fff), one = _mm256_set1_epi32(1);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    for (; i + 8 <= n; i += 8) {
      const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(s + i));
      const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, bias), odd), 16);
      const __m256i nan = _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet);
      const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs_mask), inf);
      const __m256i v = _mm256_blendv_epi8(r, nan, is_nan);
      // Both halves hold values below 2^16, so the unsigned saturating pack keeps them; it works
      // per 128-bit lane, which the permute puts back in order.
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(v, v), 0x08);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i), _mm256_castsi256_si128(packed));
    }
  }
  for (; i < n; ++i) d[i] = from_compute<S>(s[i]);
}

// d[0, n) = d[0, n) + s[0, n), each sum formed in f32 and rounded once (gradient accumulation).
template <class S>
inline void accumulate_n(S* d, const float* s, std::int64_t n) {
  constexpr std::int64_t blk = 256;
  float t[blk];
  for (std::int64_t i = 0; i < n; i += blk) {
    const std::int64_t len = std::min(blk, n - i);
    widen_n(d + i, t, len);
    for (std::int64_t j = 0; j < len; ++j) t[j] += s[i + j];
    narrow_n(t, d + i, len);
  }
}

// ---- elementwise loops
// ---------------------------------------------------------------------------

// Elements per f32 block of the 16-bit paths (a few KiB of stack per input).
inline constexpr std::int64_t half_block = 256;

namespace detail {
template <class S, class F, std::size_t... I, class... In>
void map_half(std::index_sequence<I...>, std::int64_t lo, std::int64_t hi, S* out, F& f,
              const In*... in) {
  float x[sizeof...(In)][half_block];
  float y[half_block];
  const S* src[] = {in...};
  for (std::int64_t b = lo; b < hi; b += half_block) {
    const std::int64_t len = std::min(half_block, hi - b);
    for (std::size_t k = 0; k < sizeof...(In); ++k) widen_n(src[k] + b, x[k], len);
    for (std::int64_t j = 0; j < len; ++j) y[j] = f(x[I][j]...);
    narrow_n(y, out + b, len);
  }
}
template <class S, class F, std::size_t... I, class... In>
void map2_half(std::index_sequence<I...>, std::int64_t lo, std::int64_t hi, S* out0, S* out1, F& f,
               const In*... in) {
  float x[sizeof...(In)][half_block];
  float y0[half_block], y1[half_block];
  const S* src[] = {in...};
  for (std::int64_t b = lo; b < hi; b += half_block) {
    const std::int64_t len = std::min(half_block, hi - b);
    for (std::size_t k = 0; k < sizeof...(In); ++k) widen_n(src[k] + b, x[k], len);
    for (std::int64_t j = 0; j < len; ++j) f(y0[j], y1[j], x[I][j]...);
    narrow_n(y0, out0 + b, len);
    narrow_n(y1, out1 + b, len);
  }
}
}  // namespace detail

// out[i] = f(in[i]...) for i in [0, n), on the thread pool in chunks of at least grain. f takes
// and returns compute_t<S>. out may be one of the inputs.
template <class S, class F, class... In>
void map_elements(std::int64_t n, std::int64_t grain, S* out, F&& f, const In*... in) {
  static_assert((std::is_same_v<In, S> && ...), "map_elements: one storage type");
  parallel::parallel_for(0, n, grain, [&](std::int64_t lo, std::int64_t hi) {
    if constexpr (is_half<S>) {
      detail::map_half(std::index_sequence_for<In...>{}, lo, hi, out, f, in...);
    } else {
      for (std::int64_t i = lo; i < hi; ++i) out[i] = f(in[i]...);
    }
  });
}

// f(out0[i], out1[i], in[i]...) for i in [0, n): f assigns both outputs (compute_t<S>&).
template <class S, class F, class... In>
void map_elements2(std::int64_t n, std::int64_t grain, S* out0, S* out1, F&& f, const In*... in) {
  static_assert((std::is_same_v<In, S> && ...), "map_elements2: one storage type");
  parallel::parallel_for(0, n, grain, [&](std::int64_t lo, std::int64_t hi) {
    if constexpr (is_half<S>) {
      detail::map2_half(std::index_sequence_for<In...>{}, lo, hi, out0, out1, f, in...);
    } else {
      for (std::int64_t i = lo; i < hi; ++i) f(out0[i], out1[i], in[i]...);
    }
  });
}

// ---- per-thread scratch
// --------------------------------------------------------------------------

// At least n floats (64-byte aligned) owned by the calling thread, kept for the life of the thread
// and grown when a larger n arrives (host tier memory; no allocation once the largest row has
// been seen). Callers that need several arrays carve them out of one request.
float* thread_floats(std::size_t n);

}  // namespace troupe::cpu
