// rope_frequency: the inverse frequency of one rotary pair (ops::rope_options), shared by the CPU
// and CUDA backends so that both compute the same numbers. Internal to tensor/.
//
// float follows HF's float32 arithmetic step by step (transformers' modeling_rope_utils.py, where
// every Python scalar meets a float32 tensor and is rounded to float first):
//   inv  = 1 / float(pow(float(theta), float(2i) / float(D)))       (the power rounded once)
//   linear: inv / float(factor)
//   llama3: w = (1 / inv) * float(2 pi)                              (2 pi / t is t.reciprocal() *
//   2 pi)
//           low = inv / float(factor) if w > float(L / low_freq_factor) else inv
//           s = ((1 / w) * float(L) - float(low_freq_factor)) / float(high_freq_factor -
//           low_freq_factor) medium (neither w < float(L / high_freq_factor) nor w > float(L /
//           low_freq_factor)): (1 - s) * low / float(factor) + s * low; otherwise low.
// double evaluates the same formulas in double (the exact function for the f64 tables).
#pragma once

#include <cmath>
#include <cstdint>

#include "tensor/ops.hpp"

#if defined(__CUDACC__)
#define TROUPE_ROPE_HOST_DEVICE __host__ __device__
#else
#define TROUPE_ROPE_HOST_DEVICE
#endif

namespace troupe::detail {

// T is float or double; i < d / 2.
template <class T>
TROUPE_ROPE_HOST_DEVICE inline T rope_inv_freq(std::int64_t i, std::int64_t d,
                                               const ops::rope_options& o) {
  using scaling = ops::rope_options::scaling;
  constexpr double two_pi = 6.283185307179586;  // Python's 2 * math.pi
  T inv;
  if constexpr (sizeof(T) == sizeof(float)) {
    const float expo = static_cast<float>(2 * i) / static_cast<float>(d);
    const float base_pow = static_cast<float>(
        pow(static_cast<double>(static_cast<float>(o.theta)), static_cast<double>(expo)));
    inv = 1.0f / base_pow;
  } else {
    inv = 1.0 / pow(o.theta, static_cast<double>(2 * i) / static_cast<double>(d));
  }
  if (o.type == scaling::linear) return inv / static_cast<T>(o.factor);
  if (o.type != scaling::llama3) return inv;
  const T factor = static_cast<T>(o.factor);
  const T low_wavelen = static_cast<T>(o.original_max_position / o.low_freq_factor);
  const T high_wavelen = static_cast<T>(o.original_max_position / o.high_freq_factor);
  const T wavelen = (T(1) / inv) * static_cast<T>(two_pi);
  const T scaled = wavelen > low_wavelen ? inv / factor : inv;
  if (wavelen < high_wavelen || wavelen > low_wavelen) return scaled;
  const T smooth = ((T(1) / wavelen) * static_cast<T>(o.original_max_position) -
                    static_cast<T>(o.low_freq_factor)) /
                   static_cast<T>(o.high_freq_factor - o.low_freq_factor);
  return (T(1) - smooth) * scaled / factor + smooth * scaled;
}

}  // namespace troupe::detail
