// bf16 GEMM on Intel AMX (gemm_amx.hpp).
//
// c is computed in blocks of at most 1024 x 1024, each accumulated in an f32 copy over blocks of
// 512 along the inner dimension and rounded once into c (with alpha and beta applied in f32). For
// each block the operands are packed into the calling thread's scratch: a as rows of the block
// (32-element multiples, zero padded), b in AMX's pair-interleaved layout (row p holds
// b[2p][j], b[2p+1][j] side by side for every column j). The threads then share the 32 x 32
// pieces of the f32 block; each piece keeps four 16 x 16 f32 accumulator tiles (tmm0-3) and
// streams two tiles of a (tmm4-5) and two of b (tmm6-7) per 32 steps of the inner dimension.
#include "tensor/cpu/gemm_amx.hpp"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "memory/buffer.hpp"
#include "tensor/cpu/half.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {
namespace {

constexpr std::int64_t block_m = 1024, block_n = 1024, block_k = 512;  // multiples of 32
constexpr int arch_req_xcomp_perm = 0x1023, xfeature_xtiledata = 18;

std::int64_t round32(std::int64_t x) {
  return (x + 31) / 32 * 32;
}

bool amx_present() {
  static const bool yes = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    if ((d & (1u << 22)) == 0 || (d & (1u << 24)) == 0) return false;  // AMX-BF16, AMX-TILE
    if (__get_cpuid(1, &a, &b, &c, &d) == 0 || (c & (1u << 27)) == 0) return false;  // OSXSAVE
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 0x60000u) != 0x60000u) return false;  // XCR0: XTILECFG and XTILEDATA enabled
    // Linux hands out the tile state to processes that ask (per process, for all its threads).
    return syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) == 0;
  }();
  return yes;
}

// The calling thread's packing and accumulation buffers (grown on demand, kept).
void* scratch(std::size_t bytes) {
  thread_local memory::buffer buf;
  if (buf.size() < bytes) {
    buf = memory::buffer();
    buf = memory::buffer::host(bytes);
  }
  return buf.data();
}

// ---- packing ---------------------------------------------------------------------------------

// dst[r][0, kp) (rows kp apart, r < mp) = a[m0 + r][k0, k0 + kk), zero beyond kk and mm.
void pack_a(const bf16_operand& a, std::int64_t m0, std::int64_t mm, std::int64_t k0,
            std::int64_t kk, std::int64_t kp, std::int64_t mp, std::uint16_t* dst) {
  const std::uint16_t* p = reinterpret_cast<const std::uint16_t*>(a.p);
  if (!a.trans) {
    parallel::parallel_for(0, mp, 16, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t r = lo; r < hi; ++r) {
        std::uint16_t* d = dst + r * kp;
        std::int64_t filled = 0;
        if (r < mm) {
          std::memcpy(d, p + (m0 + r) * a.ld + k0, static_cast<std::size_t>(kk) * 2);
          filled = kk;
        }
        std::memset(d + filled, 0, static_cast<std::size_t>(kp - filled) * 2);
      }
    });
    return;
  }
  // a[r][c] = p[c * ld + r]: a transpose, done in 16 x 16 squares so both sides stay in cache.
  parallel::parallel_for(0, mp / 16, 1, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t rb = lo * 16; rb < hi * 16; rb += 16) {
      for (std::int64_t cb = 0; cb < kp; cb += 16) {
        for (std::int64_t r = rb; r < rb + 16; ++r) {
          std::uint16_t* d = dst + r * kp + cb;
          if (r >= mm) {
            std::memset(d, 0, 32);
            continue;
          }
          const std::uint16_t* s = p + (k0 + cb) * a.ld + m0 + r;
          const std::int64_t n = std::clamp<std::int64_t>(kk - cb, 0, 16);
          for (std::int64_t c = 0; c < n; ++c) d[c] = s[c * a.ld];
          for (std::int64_t c = n; c < 16; ++c) d[c] = 0;
        }
      }
    }
  });
}

// dst[q][j][0..1] (pair rows 2 np apart, q < kp / 2, j < np) = b[k0 + 2q][n0 + j],
// b[k0 + 2q + 1][n0 + j], zero beyond kk and nn.
void pack_b(const bf16_operand& b, std::int64_t k0, std::int64_t kk, std::int64_t n0,
            std::int64_t nn, std::int64_t kp, std::int64_t np, std::uint16_t* dst) {
  const std::uint16_t* p = reinterpret_cast<const std::uint16_t*>(b.p);
  if (!b.trans) {
    // Rows 2q and 2q + 1 of b interleaved: 16 columns at a time with AVX2 unpacks.
    parallel::parallel_for(0, kp / 2, 8, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t q = lo; q < hi; ++q) {
        std::uint16_t* d = dst + q * 2 * np;
        const std::int64_t c0 = 2 * q, c1 = 2 * q + 1;
        if (c0 >= kk) {
          std::memset(d, 0, static_cast<std::size_t>(np) * 4);
          continue;
        }
        const std::uint16_t* s0 = p + (k0 + c0) * b.ld + n0;
        const std::uint16_t* s1 = c1 < kk ? p + (k0 + c1) * b.ld + n0 : nullptr;
        std::int64_t j = 0;
        if (s1 != nullptr) {
          for (; j + 16 <= nn; j += 16) {
            const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0 + j));
            const __m256i y = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1 + j));
            const __m256i lo16 = _mm256_unpacklo_epi16(x, y), hi16 = _mm256_unpackhi_epi16(x, y);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * j),
                                _mm256_permute2x128_si256(lo16, hi16, 0x20));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + 2 * j + 16),
                                _mm256_permute2x128_si256(lo16, hi16, 0x31));
          }
        }
        for (; j < nn; ++j) {
          d[2 * j] = s0[j];
          d[2 * j + 1] = s1 != nullptr ? s1[j] : 0;
        }
        std::memset(d + 2 * nn, 0, static_cast<std::size_t>(np - nn) * 4);
      }
    });
    return;
  }
  // b[c][j] = p[j * ld + c]: the pair (b[2q][j], b[2q + 1][j]) is 4 contiguous bytes of row j, so
  // this is a transpose of 32-bit elements, in 16 x 16 squares.
  parallel::parallel_for(0, kp / 32, 1, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t qb = lo * 16; qb < hi * 16; qb += 16) {
      for (std::int64_t jb = 0; jb < np; jb += 16) {
        for (std::int64_t q = qb; q < qb + 16; ++q) {
          std::uint32_t* d = reinterpret_cast<std::uint32_t*>(dst + q * 2 * np) + jb;
          const std::int64_t c0 = 2 * q;
          for (std::int64_t j = jb; j < jb + 16; ++j) {
            std::uint32_t v = 0;
            if (j < nn && c0 < kk) {
              const std::uint16_t* s = p + (n0 + j) * b.ld + k0 + c0;
              if (c0 + 1 < kk) {
                std::memcpy(&v, s, 4);
              } else {
                v = s[0];
              }
            }
            d[j - jb] = v;
          }
        }
      }
    }
  });
}

// ---- tiles -----------------------------------------------------------------------------------

struct alignas(64) tile_config {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

// Every tile is 16 rows of 64 bytes: 16 f32 accumulators, 32 bf16 of a, or 16 pairs of b.
void load_tile_config() {
  tile_config cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// acc[i0:i0+32][j0:j0+32] (rows np apart) += a rows i0.. (kp apart) times b pair rows (2 np
// apart), over kp; zero first if `fresh`.
void piece(const std::uint16_t* a, const std::uint16_t* b, float* acc, std::int64_t i0,
           std::int64_t j0, std::int64_t kp, std::int64_t np, bool fresh) {
  float* c00 = acc + i0 * np + j0;
  float* c10 = c00 + 16 * np;
  const long cs = static_cast<long>(np * 4), as = static_cast<long>(kp * 2),
             bs = static_cast<long>(np * 4);
  if (fresh) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c00, cs);
    _tile_loadd(1, c00 + 16, cs);
    _tile_loadd(2, c10, cs);
    _tile_loadd(3, c10 + 16, cs);
  }
  const std::uint16_t* a0 = a + i0 * kp;
  const std::uint16_t* a1 = a0 + 16 * kp;
  for (std::int64_t kt = 0; kt < kp; kt += 32) {
    const std::uint16_t* bt = b + (kt / 2) * 2 * np + 2 * j0;
    _tile_loadd(4, a0 + kt, as);
    _tile_loadd(5, a1 + kt, as);
    _tile_loadd(6, bt, bs);
    _tile_loadd(7, bt + 32, bs);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c00, cs);
  _tile_stored(1, c00 + 16, cs);
  _tile_stored(2, c10, cs);
  _tile_stored(3, c10 + 16, cs);
}

// acc (mp x np) += packed a (mp x kp) times packed b (kp x np), over the thread pool.
void block_product(const std::uint16_t* a, const std::uint16_t* b, float* acc, std::int64_t mp,
                   std::int64_t np, std::int64_t kp, bool fresh) {
  const std::int64_t pieces_n = np / 32, pieces = (mp / 32) * pieces_n;
  parallel::parallel_for(0, pieces, 1, [&](std::int64_t lo, std::int64_t hi) {
    load_tile_config();
    for (std::int64_t u = lo; u < hi; ++u)
      piece(a, b, acc, (u / pieces_n) * 32, (u % pieces_n) * 32, kp, np, fresh);
    _tile_release();
  });
}

#pragma GCC pop_options

}  // namespace

bool amx_bf16_usable() {
  const char* env = std::getenv("TROUPE_CPU_AMX");
  if (env == nullptr || std::string_view(env) != "1") return false;
  return amx_present();
}

void matmul_bf16_amx(bf16_operand a, bf16_operand b, bf16_t* c, std::int64_t ldc, std::int64_t m,
                     std::int64_t n, std::int64_t k, double alpha, double beta) {
  const std::int64_t mb = std::min(m, block_m), nb = std::min(n, block_n),
                     kb = std::min(k, block_k);
  const std::int64_t mbp = round32(mb), nbp = round32(nb), kbp = round32(kb);
  auto* ap = static_cast<std::uint16_t*>(
      scratch(static_cast<std::size_t>(mbp * kbp * 2 + kbp * nbp * 2 + mbp * nbp * 4)));
  std::uint16_t* bp = ap + mbp * kbp;
  float* acc = reinterpret_cast<float*>(bp + kbp * nbp);
  const float al = static_cast<float>(alpha), be = static_cast<float>(beta);
  std::int64_t a_at[2] = {-1, -1}, b_at[2] = {-1, -1};  // the blocks now packed
  for (std::int64_t n0 = 0; n0 < n; n0 += nb) {
    const std::int64_t nn = std::min(nb, n - n0), np = round32(nn);
    for (std::int64_t m0 = 0; m0 < m; m0 += mb) {
      const std::int64_t mm = std::min(mb, m - m0), mp = round32(mm);
      for (std::int64_t k0 = 0; k0 < k; k0 += kb) {
        const std::int64_t kk = std::min(kb, k - k0), kp = round32(kk);
        if (a_at[0] != m0 || a_at[1] != k0) {
          pack_a(a, m0, mm, k0, kk, kp, mp, ap);
          a_at[0] = m0;
          a_at[1] = k0;
        }
        if (b_at[0] != k0 || b_at[1] != n0) {
          pack_b(b, k0, kk, n0, nn, kp, np, bp);
          b_at[0] = k0;
          b_at[1] = n0;
        }
        block_product(ap, bp, acc, mp, np, kp, k0 == 0);
      }
      // c = alpha * acc + beta * c, rounded once.
      parallel::parallel_for(0, mm, 16, [&](std::int64_t lo, std::int64_t hi) {
        float t[256];
        for (std::int64_t i = lo; i < hi; ++i) {
          bf16_t* cr = c + (m0 + i) * ldc + n0;
          const float* ar = acc + i * np;
          for (std::int64_t j0 = 0; j0 < nn; j0 += 256) {
            const std::int64_t len = std::min<std::int64_t>(256, nn - j0);
            if (be != 0.0f) {
              widen_n(cr + j0, t, len);
              for (std::int64_t j = 0; j < len; ++j) t[j] = al * ar[j0 + j] + be * t[j];
            } else {
              for (std::int64_t j = 0; j < len; ++j) t[j] = al * ar[j0 + j];
            }
            narrow_n(t, cr + j0, len);
          }
        }
      });
    }
  }
}

}  // namespace troupe::cpu
