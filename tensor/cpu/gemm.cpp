// CPU GEMM: troupe::cpu::matmul on OpenBLAS, and the choice of OpenBLAS's kernels (blas_info.hpp).
//
// A 2-D view maps onto BLAS when one of its strides is 1 and the other does not make rows (or
// columns) overlap: a unit last stride is a row-major matrix (NoTrans, ld = stride(0)), a unit
// first stride is the transpose of one (Trans, ld = stride(1)). c needs a unit last stride
// (ops.cpp). bf16 products run on AMX when asked for and present (gemm_amx.hpp); other bf16
// and f16 products run on f32 copies of panels (matmul_half below).
#include <cblas.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <string>

#include "memory/error.hpp"
#include "tensor/backend.hpp"
#include "tensor/cpu/blas_info.hpp"
#include "tensor/cpu/gemm_amx.hpp"
#include "tensor/cpu/half.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"

// Exported by DYNAMIC_ARCH builds of OpenBLAS only; weak so that other builds still link (the
// selection is then skipped).
extern "C" {
void gotoblas_dynamic_init(void) __attribute__((weak));
void gotoblas_dynamic_quit(void) __attribute__((weak));
}

namespace troupe::cpu {
namespace {

std::string lower(std::string s) {
  for (char& ch : s) ch = static_cast<char>(ch >= 'A' && ch <= 'Z' ? ch - 'A' + 'a' : ch);
  return s;
}

// Instruction-set level of an OpenBLAS x86-64 core: 2 = AVX-512, 1 = AVX2, 0 = older, -1 = a name
// this table does not know (left alone).
int core_level(const std::string& core) {
  const std::string c = lower(core);
  for (const char* n : {"skylakex", "cooperlake", "sapphirerapids"})
    if (c == n) return 2;
  for (const char* n : {"haswell", "zen", "excavator"})
    if (c == n) return 1;
  for (const char* n : {"katmai",      "coppermine", "northwood",     "prescott",   "banias",
                        "atom",        "core2",      "penryn",        "dunnington", "nehalem",
                        "athlon",      "opteron",    "opteron(sse3)", "barcelona",  "nano",
                        "sandybridge", "bobcat",     "bulldozer",     "piledriver", "steamroller"})
    if (c == n) return 0;
  return -1;
}

int cpu_level() {
  if (cpu_has_avx512()) return 2;
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 1;
  return 0;
}

const char* best_core(int level) {
  return level >= 2 ? "SkylakeX" : "Haswell";
}

// Re-runs OpenBLAS's core selection with OPENBLAS_CORETYPE = value (unset for nullptr).
void reselect(const char* value) {
  if (value != nullptr)
    setenv("OPENBLAS_CORETYPE", value, 1);
  else
    unsetenv("OPENBLAS_CORETYPE");
  gotoblas_dynamic_quit();
  gotoblas_dynamic_init();
}

// The BLAS description of one operand.
struct blas_operand {
  CBLAS_TRANSPOSE trans;
  std::int64_t ld;
};

// a[rows, cols] as a row-major matrix (NoTrans) or the transpose of one (Trans).
blas_operand layout(const char* name, const tensor& x) {
  const std::int64_t rows = x.size(0), cols = x.size(1);
  if (cols <= 1 || x.stride(1) == 1) {
    std::int64_t ld = rows <= 1 ? std::max<std::int64_t>(cols, 1) : x.stride(0);
    if (ld >= std::max<std::int64_t>(cols, 1)) return {CblasNoTrans, ld};
  }
  if (rows <= 1 || x.stride(0) == 1) {
    std::int64_t ld = cols <= 1 ? std::max<std::int64_t>(rows, 1) : x.stride(1);
    if (ld >= std::max<std::int64_t>(rows, 1)) return {CblasTrans, ld};
  }
  TROUPE_FAIL("cpu matmul: ", name, " has no BLAS layout (a unit stride in one dimension and ",
              "non-overlapping rows or columns in the other), got ", x.describe());
}

template <class T>
void scale_rows(const tensor& c, double beta) {
  T* p = static_cast<T*>(c.data());
  for (std::int64_t i = 0; i < c.size(0); ++i)
    for (std::int64_t j = 0; j < c.size(1); ++j) {
      T& x = p[i * c.stride(0) + j * c.stride(1)];
      x = from_compute<T>(beta == 0.0 ? compute_t<T>(0)
                                      : static_cast<compute_t<T>>(beta * to_compute(x)));
    }
}

// ---- bf16 and f16 ------------------------------------------------------------------------------
// OpenBLAS has no 16-bit GEMM here, so the product runs on f32 copies of blocks: c in tiles of
// tile_m x tile_n, each accumulated by SGEMM in f32 over blocks of tile_k along the inner
// dimension (beta applies to the widened old tile on the first block) and rounded once into c.
// Blocks keep their operand's orientation, so widening reads and writes contiguous runs. The copies
// cost about mkn / tile_n + kn m / tile_m conversions against 2mnk flops (under 0.1%), and the
// scratch is at most 8 MiB (the calling thread's, reused).

inline constexpr std::int64_t tile_m = 1024, tile_n = 1024, tile_k = 512;

// Rows [r0, r1) and columns [c0, c1) of x (laid out as l) widened into dst; returns the layout of
// the copy.
template <class S>
blas_operand widen_block(const tensor& x, blas_operand l, std::int64_t r0, std::int64_t r1,
                         std::int64_t c0, std::int64_t c1, float* dst) {
  const S* p = static_cast<const S*>(x.data());
  const bool by_rows = l.trans == CblasNoTrans;
  const std::int64_t runs = by_rows ? r1 - r0 : c1 - c0, len = by_rows ? c1 - c0 : r1 - r0;
  const S* first = by_rows ? p + r0 * l.ld + c0 : p + c0 * l.ld + r0;
  parallel::parallel_for(0, runs, row_grain(len), [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t u = lo; u < hi; ++u) widen_n(first + u * l.ld, dst + u * len, len);
  });
  return {l.trans, len};
}

template <class S>
void matmul_half(const tensor& a, const tensor& b, const tensor& c, blas_operand pa,
                 blas_operand pb, std::int64_t ldc, double alpha, double beta) {
  const std::int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const std::int64_t mb = std::min(m, tile_m), nb = std::min(n, tile_n), kb = std::min(k, tile_k);
  float* ap = thread_floats(static_cast<std::size_t>(mb * kb + kb * nb + mb * nb));
  float* bp = ap + mb * kb;
  float* cp = bp + kb * nb;
  S* cs = static_cast<S*>(c.data());
  // The blocks now in ap and bp (a whole operand that fits is widened once).
  std::int64_t a_at[2] = {-1, -1}, b_at[2] = {-1, -1};
  blas_operand wa{}, wb{};
  for (std::int64_t n0 = 0; n0 < n; n0 += nb) {
    const std::int64_t nn = std::min(nb, n - n0);
    for (std::int64_t m0 = 0; m0 < m; m0 += mb) {
      const std::int64_t mm = std::min(mb, m - m0);
      auto for_rows = [&](auto&& f) {
        parallel::parallel_for(0, mm, row_grain(nn), [&](std::int64_t lo, std::int64_t hi) {
          for (std::int64_t i = lo; i < hi; ++i) f(i);
        });
      };
      if (beta != 0.0)
        for_rows([&](std::int64_t i) { widen_n(cs + (m0 + i) * ldc + n0, cp + i * nn, nn); });
      for (std::int64_t k0 = 0; k0 < k; k0 += kb) {
        const std::int64_t kk = std::min(kb, k - k0);
        if (a_at[0] != m0 || a_at[1] != k0) {
          wa = widen_block<S>(a, pa, m0, m0 + mm, k0, k0 + kk, ap);
          a_at[0] = m0;
          a_at[1] = k0;
        }
        if (b_at[0] != k0 || b_at[1] != n0) {
          wb = widen_block<S>(b, pb, k0, k0 + kk, n0, n0 + nn, bp);
          b_at[0] = k0;
          b_at[1] = n0;
        }
        const float beta_k = k0 == 0 ? static_cast<float>(beta) : 1.0f;
        cblas_sgemm(CblasRowMajor, wa.trans, wb.trans, static_cast<int>(mm), static_cast<int>(nn),
                    static_cast<int>(kk), static_cast<float>(alpha), ap, static_cast<int>(wa.ld),
                    bp, static_cast<int>(wb.ld), beta_k, cp, static_cast<int>(nn));
      }
      for_rows([&](std::int64_t i) { narrow_n(cp + i * nn, cs + (m0 + i) * ldc + n0, nn); });
    }
  }
}

}  // namespace

bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}

bool is_avx512_core(const std::string& core) {
  return core_level(core) == 2;
}

std::string blas_core() {
  const char* n = openblas_get_corename();
  return n != nullptr ? std::string(n) : std::string("unknown");
}

blas_core_choice select_blas_core() {
  blas_core_choice c;
  c.before = c.after = blas_core();
  const int want = cpu_level(), have = core_level(c.before);
  const char* keep = std::getenv("TROUPE_KEEP_OPENBLAS_CORETYPE");
  if (keep != nullptr && std::string(keep) == "1") {
    c.reason = "kept " + c.before + " (TROUPE_KEEP_OPENBLAS_CORETYPE=1)";
    return c;
  }
  if (gotoblas_dynamic_init == nullptr || gotoblas_dynamic_quit == nullptr) {
    c.reason = "kept " + c.before + " (OpenBLAS built without DYNAMIC_ARCH: no core selection)";
    return c;
  }
  if (have < 0 || have >= want) {
    c.reason =
        "kept " + c.before + (have < 0 ? " (a core troupe does not rank)" : " (fits the CPU)");
    return c;
  }
  const char* env = std::getenv("OPENBLAS_CORETYPE");
  const std::optional<std::string> saved = env ? std::optional<std::string>(env) : std::nullopt;
  std::string how;
  if (saved) {  // OpenBLAS's own detection first, as if the variable were not set
    reselect(nullptr);
    how = "OPENBLAS_CORETYPE=" + *saved + " hidden";
  }
  if (core_level(blas_core()) < want) {  // detection missed this CPU (or the variable was unset)
    reselect(best_core(want));
    how += std::string(how.empty() ? "" : ", then ") + best_core(want) + " named";
  }
  if (saved)
    setenv("OPENBLAS_CORETYPE", saved->c_str(), 1);
  else
    unsetenv("OPENBLAS_CORETYPE");
  c.after = blas_core();
  c.overridden = c.after != c.before;
  c.reason = c.before + " is weaker than this CPU (" + (want == 2 ? "AVX-512" : "AVX2") +
             "): re-selected " + c.after + " (" + how + ")";
  return c;
}

const blas_core_choice& ensure_blas_core() {
  static std::once_flag once;
  static blas_core_choice choice;
  std::call_once(once, [] {
    choice = select_blas_core();
    openblas_set_num_threads(parallel::num_threads());  // one thread count for troupe and BLAS
  });
  return choice;
}

void matmul(const tensor& a, const tensor& b, const tensor& c, double alpha, double beta) {
  const dtype t = c.type();
  TROUPE_CHECK(is_floating(t), "cpu matmul: dtype ", dtype_name(t),
               " not supported (f32, f64, bf16 and f16 are)");
  const std::int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (m == 0 || n == 0) return;
  TROUPE_CHECK(m <= INT_MAX && n <= INT_MAX && k <= INT_MAX, "cpu matmul: dimensions beyond ",
               INT_MAX, " (BLAS int): a is ", a.describe(), ", b is ", b.describe());
  const std::int64_t ldc = m <= 1 ? std::max<std::int64_t>(n, 1) : c.stride(0);
  TROUPE_CHECK(ldc >= n, "cpu matmul: c has overlapping rows, got ", c.describe());
  if (k == 0) {  // an empty sum: c = beta * c
    dispatch_floating("matmul", t, [&]<class S>(S) { scale_rows<S>(c, beta); });
    return;
  }
  const blas_operand pa = layout("a", a), pb = layout("b", b);
  TROUPE_CHECK(pa.ld <= INT_MAX && pb.ld <= INT_MAX && ldc <= INT_MAX,
               "cpu matmul: a leading dimension beyond ", INT_MAX, " (BLAS int)");
  ensure_blas_core();
  const int im = static_cast<int>(m), in = static_cast<int>(n), ik = static_cast<int>(k);
  if (t == dtype::bf16 && amx_bf16_usable()) {
    auto operand = [](const tensor& x, blas_operand l) {
      return bf16_operand{static_cast<const bf16_t*>(x.data()), l.trans == CblasTrans, l.ld};
    };
    return matmul_bf16_amx(operand(a, pa), operand(b, pb), static_cast<bf16_t*>(c.data()), ldc, m,
                           n, k, alpha, beta);
  }
  if (t == dtype::bf16) return matmul_half<bf16_t>(a, b, c, pa, pb, ldc, alpha, beta);
  if (t == dtype::f16) return matmul_half<f16_t>(a, b, c, pa, pb, ldc, alpha, beta);
  if (t == dtype::f32) {
    cblas_sgemm(CblasRowMajor, pa.trans, pb.trans, im, in, ik, static_cast<float>(alpha),
                static_cast<const float*>(a.data()), static_cast<int>(pa.ld),
                static_cast<const float*>(b.data()), static_cast<int>(pb.ld),
                static_cast<float>(beta), static_cast<float*>(c.data()), static_cast<int>(ldc));
  } else {
    cblas_dgemm(CblasRowMajor, pa.trans, pb.trans, im, in, ik, alpha,
                static_cast<const double*>(a.data()), static_cast<int>(pa.ld),
                static_cast<const double*>(b.data()), static_cast<int>(pb.ld), beta,
                static_cast<double*>(c.data()), static_cast<int>(ldc));
  }
}

}  // namespace troupe::cpu

namespace troupe::parallel {
void set_blas_threads(int n) {
  openblas_set_num_threads(std::max(1, n));
}
}  // namespace troupe::parallel
