// The byte codec of role requests and replies: user structs to bytes and back, no CAF involved.
//
// A value is encodable when it is
//   - a struct with a member `auto fields() { return std::tie(a, b, c); }` (each field encodable),
//   - trivially copyable (ints, floats, enums, plain structs of those: copied as bytes),
//   - std::string, std::vector<T>, std::map<K, V>, std::pair<A, B>, std::optional<T>,
//     std::array<T, N> of encodable values.
// Lengths are 64-bit; every decode checks the remaining bytes, so a short or corrupt payload is a
// troupe::error naming the type, never a read past the end. Both sides must run the same binary
// (or at least the same struct definitions): the format carries no field names.
#pragma once

#include <cxxabi.h>
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>
#include <vector>

#include "memory/error.hpp"

namespace troupe::actors {

using bytes = std::vector<char>;

namespace codec_detail {

template <class T>
concept has_fields = requires(T& x) {
  x.fields();
};

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_map : std::false_type {};
template <class K, class V, class C, class A>
struct is_map<std::map<K, V, C, A>> : std::true_type {};
template <class T>
struct is_pair : std::false_type {};
template <class A, class B>
struct is_pair<std::pair<A, B>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_array : std::false_type {};
template <class T, std::size_t N>
struct is_array<std::array<T, N>> : std::true_type {};

// Encoded as raw bytes: trivially copyable and not one of the structured cases above.
template <class T>
inline constexpr bool is_raw =
    std::is_trivially_copyable_v<T> && !has_fields<T> && !is_pair<T>::value && !is_array<T>::value;

class writer {
 public:
  explicit writer(bytes& out) : out_(out) {}
  void raw(const void* p, std::size_t n) {
    const auto at = out_.size();
    out_.resize(at + n);
    if (n) std::memcpy(out_.data() + at, p, n);
  }
  void length(std::size_t n) {
    const std::uint64_t v = n;
    raw(&v, sizeof v);
  }

 private:
  bytes& out_;
};

class reader {
 public:
  reader(const char* p, std::size_t n, const char* type) : p_(p), n_(n), type_(type) {}
  void raw(void* dst, std::size_t n) {
    need(n);
    if (n) std::memcpy(dst, p_ + at_, n);
    at_ += n;
  }
  std::size_t length(std::size_t min_element_bytes) {
    std::uint64_t v = 0;
    raw(&v, sizeof v);
    // Every element takes at least min_element_bytes: a larger count is corrupt.
    if (min_element_bytes > 0 && v > (n_ - at_) / min_element_bytes)
      TROUPE_FAIL("decode ", type_, ": a length of ", v, " at byte ", at_ - sizeof v,
                  " exceeds the ", n_ - at_, " bytes left");
    return static_cast<std::size_t>(v);
  }
  std::size_t left() const { return n_ - at_; }
  const char* type() const { return type_; }

 private:
  void need(std::size_t n) {
    if (n > n_ - at_)
      TROUPE_FAIL("decode ", type_, ": payload too short (", n, " more bytes needed at byte ", at_,
                  " of ", n_, ")");
  }
  const char* p_;
  std::size_t n_, at_ = 0;
  const char* type_;
};

template <class T>
constexpr std::size_t min_bytes() {
  if constexpr (is_raw<T>)
    return sizeof(T);
  else
    return 0;  // structured values may be empty in principle; the reader still bounds-checks
}

template <class T>
void put(writer& w, const T& x);
template <class T>
void get(reader& r, T& x);

template <class T>
void put(writer& w, const T& x) {
  if constexpr (has_fields<T>) {
    auto f = const_cast<T&>(x).fields();
    std::apply([&](auto&... m) { (put(w, m), ...); }, f);
  } else if constexpr (std::is_same_v<T, std::string>) {
    w.length(x.size());
    w.raw(x.data(), x.size());
  } else if constexpr (is_vector<T>::value) {
    using E = typename T::value_type;
    w.length(x.size());
    if constexpr (is_raw<E> && !std::is_same_v<E, bool>)
      w.raw(x.data(), x.size() * sizeof(E));
    else
      for (const auto& e : x) put(w, static_cast<const E&>(e));
  } else if constexpr (is_map<T>::value) {
    w.length(x.size());
    for (const auto& [k, v] : x) {
      put(w, k);
      put(w, v);
    }
  } else if constexpr (is_pair<T>::value) {
    put(w, x.first);
    put(w, x.second);
  } else if constexpr (is_optional<T>::value) {
    const std::uint8_t has = x.has_value() ? 1 : 0;
    w.raw(&has, 1);
    if (has) put(w, *x);
  } else if constexpr (is_array<T>::value) {
    for (const auto& e : x) put(w, e);
  } else {
    static_assert(is_raw<T>,
                  "not encodable: give the struct `auto fields() { return std::tie(...); }`");
    w.raw(&x, sizeof(T));
  }
}

template <class T>
void get(reader& r, T& x) {
  if constexpr (has_fields<T>) {
    auto f = x.fields();
    std::apply([&](auto&... m) { (get(r, m), ...); }, f);
  } else if constexpr (std::is_same_v<T, std::string>) {
    x.resize(r.length(1));
    r.raw(x.data(), x.size());
  } else if constexpr (is_vector<T>::value) {
    using E = typename T::value_type;
    const std::size_t n = r.length(std::max<std::size_t>(1, min_bytes<E>()));
    if constexpr (is_raw<E> && !std::is_same_v<E, bool>) {
      x.resize(n);
      r.raw(x.data(), n * sizeof(E));
    } else {
      x.clear();
      x.reserve(n);
      for (std::size_t i = 0; i < n; ++i) {
        E e{};
        get(r, e);
        x.push_back(std::move(e));
      }
    }
  } else if constexpr (is_map<T>::value) {
    const std::size_t n = r.length(1);
    x.clear();
    for (std::size_t i = 0; i < n; ++i) {
      typename T::key_type k{};
      typename T::mapped_type v{};
      get(r, k);
      get(r, v);
      x.emplace(std::move(k), std::move(v));
    }
  } else if constexpr (is_pair<T>::value) {
    get(r, x.first);
    get(r, x.second);
  } else if constexpr (is_optional<T>::value) {
    std::uint8_t has = 0;
    r.raw(&has, 1);
    if (has) {
      typename T::value_type v{};
      get(r, v);
      x = std::move(v);
    } else {
      x.reset();
    }
  } else if constexpr (is_array<T>::value) {
    for (auto& e : x) get(r, e);
  } else {
    static_assert(is_raw<T>,
                  "not decodable: give the struct `auto fields() { return std::tie(...); }`");
    r.raw(&x, sizeof(T));
  }
}

}  // namespace codec_detail

// The name a request or reply type travels under: `T::kind` when the type defines it (a
// std::string_view or const char*), else its demangled type name (the same in every process of one
// binary), e.g. "app::sum_request".
template <class T>
std::string kind_of() {
  static const std::string kind = [] {
    if constexpr (requires { T::kind; }) {
      return std::string(std::string_view(T::kind));
    } else {
      int status = 0;
      char* d = abi::__cxa_demangle(typeid(T).name(), nullptr, nullptr, &status);
      std::string s = status == 0 && d ? std::string(d) : std::string(typeid(T).name());
      std::free(d);
      return s;
    }
  }();
  return kind;
}

template <class T>
void encode_into(bytes& out, const T& value) {
  codec_detail::writer w(out);
  codec_detail::put(w, value);
}

template <class T>
bytes encode(const T& value) {
  bytes out;
  encode_into(out, value);
  return out;
}

// Decodes a whole payload: trailing bytes are an error too (they mean the types differ).
template <class T>
T decode(const char* data, std::size_t size) {
  const std::string kind = kind_of<T>();
  codec_detail::reader r(data, size, kind.c_str());
  T value{};
  codec_detail::get(r, value);
  if (r.left() != 0)
    TROUPE_FAIL("decode ", kind, ": ", r.left(), " trailing bytes (the sender's type differs)");
  return value;
}

template <class T>
T decode(const bytes& payload) {
  return decode<T>(payload.data(), payload.size());
}

}  // namespace troupe::actors
