// Element types and the scalar conversions between them.
#pragma once

#include <cstdint>
#include <cstring>
#include <string_view>

namespace troupe {

enum class dtype : std::uint8_t { f32, f64, bf16, f16, i32, i64, u8 };

constexpr std::size_t dtype_size(dtype t) {
  switch (t) {
    case dtype::f32:
      return 4;
    case dtype::f64:
      return 8;
    case dtype::bf16:
      return 2;
    case dtype::f16:
      return 2;
    case dtype::i32:
      return 4;
    case dtype::i64:
      return 8;
    case dtype::u8:
      return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(dtype t) {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f64:
      return "f64";
    case dtype::bf16:
      return "bf16";
    case dtype::f16:
      return "f16";
    case dtype::i32:
      return "i32";
    case dtype::i64:
      return "i64";
    case dtype::u8:
      return "u8";
  }
  return "?";
}

constexpr bool is_floating(dtype t) {
  return t == dtype::f32 || t == dtype::f64 || t == dtype::bf16 || t == dtype::f16;
}

// 16-bit storage types. Arithmetic happens in f32.
struct bf16_t {
  std::uint16_t bits;
};
struct f16_t {
  std::uint16_t bits;
};

template <class T>
struct dtype_of_t;
template <>
struct dtype_of_t<float> {
  static constexpr dtype value = dtype::f32;
};
template <>
struct dtype_of_t<double> {
  static constexpr dtype value = dtype::f64;
};
template <>
struct dtype_of_t<bf16_t> {
  static constexpr dtype value = dtype::bf16;
};
template <>
struct dtype_of_t<f16_t> {
  static constexpr dtype value = dtype::f16;
};
template <>
struct dtype_of_t<std::int32_t> {
  static constexpr dtype value = dtype::i32;
};
template <>
struct dtype_of_t<std::int64_t> {
  static constexpr dtype value = dtype::i64;
};
template <>
struct dtype_of_t<std::uint8_t> {
  static constexpr dtype value = dtype::u8;
};
template <class T>
inline constexpr dtype dtype_of = dtype_of_t<T>::value;

// f32 -> bf16 rounds to nearest even; NaN stays NaN.
inline std::uint16_t f32_to_bf16_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}
inline float bf16_bits_to_f32(std::uint16_t h) {
  std::uint32_t u = static_cast<std::uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half precision, round to nearest even, with subnormals, infinities and NaN.
inline std::uint16_t f32_to_f16_bits(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  std::uint32_t sign = (x >> 16) & 0x8000u;
  std::uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u)
    return static_cast<std::uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (ax < 0x38800000u) {  // subnormal or zero in f16
    if (ax < 0x33000000u) return static_cast<std::uint16_t>(sign);
    std::uint32_t e = ax >> 23;
    std::uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    std::uint32_t shift = 126 - e;  // 14 + (113 - e) - 1 ... bring to 10-bit mantissa
    std::uint32_t r = m >> (shift);
    std::uint32_t rem = m & ((1u << shift) - 1);
    std::uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = ((ax - 0x38000000u) >> 13);
  std::uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<std::uint16_t>(sign | r);
}
inline float f16_bits_to_f32(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t e = (h >> 10) & 0x1fu;
  std::uint32_t m = h & 0x3ffu;
  std::uint32_t u;
  if (e == 0) {
    if (m == 0) {
      u = sign;
    } else {  // subnormal: normalize
      e = 113;
      while ((m & 0x400u) == 0) {
        m <<= 1;
        --e;
      }
      u = sign | (e << 23) | ((m & 0x3ffu) << 13);
    }
  } else if (e == 31) {
    u = sign | 0x7f800000u | (m << 13);
  } else {
    u = sign | ((e + 112) << 23) | (m << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace troupe
