#include "tensor/attention_merge.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "memory/error.hpp"
#include "tensor/parallel.hpp"

namespace troupe::ops {
namespace {

template <class T>
void merge_rows(const tensor& out, const tensor& lse, const tensor& part_out,
                const tensor& part_lse) {
  const std::int64_t b = out.size(0), t = out.size(1), h = out.size(2), d = out.size(3);
  T* o = static_cast<T*>(out.data());
  const T* po = static_cast<const T*>(part_out.data());
  T* l = static_cast<T*>(lse.data());
  const T* pl = static_cast<const T*>(part_lse.data());
  constexpr double neg_inf = -std::numeric_limits<double>::infinity();
  // One item per (b, h, t) row; a few hundred rows per chunk keeps the pool's overhead small.
  parallel::parallel_for(0, b * h * t, 256, [&](std::int64_t i0, std::int64_t i1) {
    for (std::int64_t i = i0; i < i1; ++i) {
      const std::int64_t bi = i / (h * t), hi = (i / t) % h, ti = i % t;
      T* lp = l + bi * lse.stride(0) + hi * lse.stride(1) + ti * lse.stride(2);
      const double a = static_cast<double>(*lp);
      const double p = static_cast<double>(
          pl[bi * part_lse.stride(0) + hi * part_lse.stride(1) + ti * part_lse.stride(2)]);
      if (p == neg_inf) continue;  // the block saw no key: nothing to add
      T* orow = o + bi * out.stride(0) + ti * out.stride(1) + hi * out.stride(2);
      const T* prow =
          po + bi * part_out.stride(0) + ti * part_out.stride(1) + hi * part_out.stride(2);
      if (a == neg_inf) {
        std::copy(prow, prow + d, orow);
        *lp = static_cast<T>(p);
        continue;
      }
      const double m = std::max(a, p);
      const double merged = m + std::log(std::exp(a - m) + std::exp(p - m));
      const double wa = std::exp(a - merged), wp = std::exp(p - merged);
      for (std::int64_t j = 0; j < d; ++j)
        orow[j] =
            static_cast<T>(wa * static_cast<double>(orow[j]) + wp * static_cast<double>(prow[j]));
      *lp = static_cast<T>(merged);
    }
  });
}

}  // namespace

void attention_merge(const tensor& out, const tensor& lse, const tensor& part_out,
                     const tensor& part_lse) {
  const char* op = "attention_merge";
  TROUPE_CHECK(out.defined() && lse.defined() && part_out.defined() && part_lse.defined(), op,
               ": every argument must be defined");
  for (const tensor* x : {&out, &lse, &part_out, &part_lse})
    TROUPE_CHECK(x->is_cpu(), op, ": runs on the CPU only (no CUDA kernel yet), got ",
                 x->describe());
  TROUPE_CHECK(out.dim() == 4 && part_out.sizes() == out.sizes(), op,
               ": out and part_out must be one [B, T, H, D] shape, got ", out.describe(), " and ",
               part_out.describe());
  TROUPE_CHECK(out.last_dim_contiguous() && part_out.last_dim_contiguous(), op,
               ": out and part_out need a contiguous last dimension, got ", out.describe(), " and ",
               part_out.describe());
  const shape want{out.size(0), out.size(2), out.size(1)};
  TROUPE_CHECK(lse.sizes() == want && part_lse.sizes() == want, op, ": lse and part_lse must be ",
               want.str(), ", got ", lse.describe(), " and ", part_lse.describe());
  for (const tensor* x : {&lse, &part_out, &part_lse})
    TROUPE_CHECK(x->type() == out.type(), op, ": every argument must be ", dtype_name(out.type()),
                 ", got ", x->describe());
  if (out.type() == dtype::f32) return merge_rows<float>(out, lse, part_out, part_lse);
  if (out.type() == dtype::f64) return merge_rows<double>(out, lse, part_out, part_lse);
  TROUPE_FAIL(op, ": f32 and f64 only, got ", dtype_name(out.type()));
}

}  // namespace troupe::ops
