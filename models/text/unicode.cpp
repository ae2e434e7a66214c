// UTF-8 decoding and Unicode class lookup by binary search over generated ranges.
#include "models/text/unicode.hpp"

#include <algorithm>
#include <array>
#include <iterator>

namespace troupe::models {
namespace {

struct class_range {
  char32_t first, last;
  char_class cls;
};

constexpr class_range kRanges[] = {
#include "models/text/unicode_tables.inc"
};

constexpr bool sorted_and_disjoint() {
  for (std::size_t i = 0; i < std::size(kRanges); ++i) {
    if (kRanges[i].first > kRanges[i].last) return false;
    if (i > 0 && kRanges[i - 1].last >= kRanges[i].first) return false;
  }
  return true;
}
static_assert(sorted_and_disjoint(), "unicode_tables.inc must hold sorted, disjoint ranges");

char_class lookup(char32_t cp) {
  auto it = std::upper_bound(std::begin(kRanges), std::end(kRanges), cp,
                             [](char32_t c, const class_range& r) { return c < r.first; });
  if (it == std::begin(kRanges)) return char_class::other;
  --it;
  return cp <= it->last ? it->cls : char_class::other;
}

}  // namespace

char_class classify(char32_t cp) {
  static const auto ascii = [] {
    std::array<char_class, 128> t{};
    for (char32_t c = 0; c < 128; ++c) t[c] = lookup(c);
    return t;
  }();
  return cp < 128 ? ascii[cp] : lookup(cp);
}

int decode_utf8(std::string_view s, std::size_t i, char32_t& cp) {
  auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned c0 = b(i);
  cp = 0xFFFD;
  if (c0 < 0x80) {
    cp = c0;
    return 1;
  }
  int len = c0 >= 0xF0 ? 4 : c0 >= 0xE0 ? 3 : c0 >= 0xC0 ? 2 : 0;
  if (len == 0 || c0 > 0xF4 || i + len > s.size()) return 1;
  char32_t v = c0 & (0x7F >> len);
  for (int k = 1; k < len; ++k) {
    unsigned ck = b(i + k);
    if ((ck & 0xC0) != 0x80) return 1;
    v = (v << 6) | (ck & 0x3F);
  }
  static constexpr char32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  if (v < kMin[len] || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF)) return 1;
  cp = v;
  return len;
}

}  // namespace troupe::models
