// CPU backend: fused softmax + cross-entropy, forward and gradient in one pass over the logits.
//
// Per row: m = max(logits), s = sum exp(logits - m), lse = m + log s, loss = lse - logits[target].
// The exps are written straight into dlogits and rescaled by grad_scale / s afterwards, so the row
// is read twice and exp is evaluated once per element. logits[target] is read before anything is
// written, which is what lets dlogits alias logits. Targets are checked before any row is touched.
#include <cmath>

#include "memory/error.hpp"
#include "tensor/backend.hpp"
#include "tensor/cpu/fast_math.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {
namespace {

template <class I>
std::int64_t check_targets(const I* tp, std::int64_t n, std::int64_t v, std::int64_t ignore) {
  std::int64_t counted = 0;
  for (std::int64_t r = 0; r < n; ++r) {
    const std::int64_t t = static_cast<std::int64_t>(tp[r]);
    if (t == ignore) continue;
    TROUPE_CHECK(t >= 0 && t < v, "cpu cross_entropy: target ", t, " at row ", r,
                 " is outside [0, ", v, ") and is not ignore_index (", ignore, ")");
    ++counted;
  }
  return counted;
}

template <class T, class I>
std::int64_t cross_entropy_typed(const tensor& logits, const tensor& targets, const tensor& losses,
                                 const tensor& dlogits, double grad_scale,
                                 std::int64_t ignore_index) {
  const std::int64_t v = logits.size(-1);
  const std::int64_t n = v == 0 ? 0 : logits.numel() / v;
  const T* xp = static_cast<const T*>(logits.data());
  const I* tp = static_cast<const I*>(targets.data());
  T* lp = static_cast<T*>(losses.data());
  T* dp = dlogits.defined() ? static_cast<T*>(dlogits.data()) : nullptr;
  const std::int64_t counted = check_targets(tp, n, v, ignore_index);
  parallel::parallel_for(0, n, row_grain(v, exp_grain), [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t r = lo; r < hi; ++r) {
      const T* x = xp + r * v;
      T* d = dp != nullptr ? dp + r * v : nullptr;
      const std::int64_t t = static_cast<std::int64_t>(tp[r]);
      if (t == ignore_index) {
        lp[r] = T(0);
        if (d != nullptr)
          for (std::int64_t i = 0; i < v; ++i) d[i] = T(0);
        continue;
      }
      const double xt = static_cast<double>(x[t]);
      const T m = lane_max(x, v);
      double s;
      if (d != nullptr) {
        s = lane_sum<T>(0, v, [&](std::int64_t i) {
          T e = exp_fast(x[i] - m);
          d[i] = e;
          return e;
        });
      } else {
        s = lane_sum<T>(0, v, [&](std::int64_t i) { return exp_fast(x[i] - m); });
      }
      lp[r] = static_cast<T>(static_cast<double>(m) + std::log(s) - xt);
      if (d != nullptr) {
        const T k = static_cast<T>(grad_scale / s);
        for (std::int64_t i = 0; i < v; ++i) d[i] *= k;
        d[t] -= static_cast<T>(grad_scale);
      }
    }
  });
  return counted;
}

}  // namespace

std::int64_t cross_entropy(const tensor& logits, const tensor& targets, const tensor& losses,
                           const tensor& dlogits, double grad_scale, std::int64_t ignore_index) {
  return dispatch_float("cross_entropy", logits.type(), [&]<class T>(T) -> std::int64_t {
    switch (targets.type()) {
      case dtype::i32:
        return cross_entropy_typed<T, std::int32_t>(logits, targets, losses, dlogits, grad_scale,
                                                    ignore_index);
      case dtype::i64:
        return cross_entropy_typed<T, std::int64_t>(logits, targets, losses, dlogits, grad_scale,
                                                    ignore_index);
      default:
        break;
    }
    TROUPE_FAIL("cpu cross_entropy: targets must be i32 or i64, got ", dtype_name(targets.type()));
  });
}

}  // namespace troupe::cpu
