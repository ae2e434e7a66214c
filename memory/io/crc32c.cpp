// crc32c: hardware (SSE4.2) and table implementations; see crc32c.hpp.
#include "memory/io/crc32c.hpp"

#include <array>
#include <cstring>

namespace troupe::memory::io {
namespace {

constexpr std::uint32_t poly = 0x82F63B78u;  // reflected Castagnoli polynomial

constexpr std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ poly : c >> 1;
    t[i] = c;
  }
  return t;
}
constexpr auto table = make_table();

std::uint32_t sw_update(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  for (std::size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) std::uint32_t hw_update(std::uint32_t crc, const unsigned char* p,
                                                          std::size_t n) {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t w;
    std::memcpy(&w, p, 8);
    c = __builtin_ia32_crc32di(c, w);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<std::uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}

// Four blocks at once: four independent dependency chains keep the crc32 unit busy.
__attribute__((target("sse4.2"))) void hw_blocks4(const unsigned char* p, std::size_t block,
                                                  std::uint32_t* out) {
  std::uint64_t c0 = ~0u, c1 = ~0u, c2 = ~0u, c3 = ~0u;
  const unsigned char *p0 = p, *p1 = p + block, *p2 = p + 2 * block, *p3 = p + 3 * block;
  for (std::size_t i = 0; i < block; i += 8) {
    std::uint64_t w0, w1, w2, w3;
    std::memcpy(&w0, p0 + i, 8);
    std::memcpy(&w1, p1 + i, 8);
    std::memcpy(&w2, p2 + i, 8);
    std::memcpy(&w3, p3 + i, 8);
    c0 = __builtin_ia32_crc32di(c0, w0);
    c1 = __builtin_ia32_crc32di(c1, w1);
    c2 = __builtin_ia32_crc32di(c2, w2);
    c3 = __builtin_ia32_crc32di(c3, w3);
  }
  out[0] = ~static_cast<std::uint32_t>(c0);
  out[1] = ~static_cast<std::uint32_t>(c1);
  out[2] = ~static_cast<std::uint32_t>(c2);
  out[3] = ~static_cast<std::uint32_t>(c3);
}
#endif

bool detect_hw() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}
const bool have_hw = detect_hw();

std::uint32_t update(std::uint32_t crc, const unsigned char* p, std::size_t n) {
#if defined(__x86_64__)
  if (have_hw) return hw_update(crc, p, n);
#endif
  return sw_update(crc, p, n);
}

}  // namespace

bool crc32c_hardware() {
  return have_hw;
}

std::uint32_t crc32c(const void* p, std::size_t n) {
  return ~update(~0u, static_cast<const unsigned char*>(p), n);
}

void crc32c_blocks(const void* p, std::size_t block, std::size_t n_blocks, std::uint32_t* out) {
  auto* b = static_cast<const unsigned char*>(p);
  std::size_t i = 0;
#if defined(__x86_64__)
  if (have_hw && block % 8 == 0)
    for (; i + 4 <= n_blocks; i += 4) hw_blocks4(b + i * block, block, out + i);
#endif
  for (; i < n_blocks; ++i) out[i] = crc32c(b + i * block, block);
}

}  // namespace troupe::memory::io
