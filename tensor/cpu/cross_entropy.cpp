// CPU backend: fused softmax + cross-entropy, forward and gradient in one pass over the logits.
//
// Per row: m = max(logits), s = sum exp(logits - m), lse = m + log s, loss = lse - logits[target].
// The exps are written straight into dlogits and rescaled by grad_scale / s afterwards, so the row
// is read twice and exp is evaluated once per element. logits[target] is read before anything is
// written, which is what lets dlogits alias logits. Targets are checked before any row is touched.
// bf16 and f16 logits compute in f32 (a row at a time in per-thread scratch) and round dlogits
// once; their losses may be f32.
#include <cmath>

#include "memory/error.hpp"
#include "tensor/backend.hpp"
#include "tensor/cpu/fast_math.hpp"
#include "tensor/cpu/half.hpp"
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

// One row in the compute type T: x the logits, d (null: no gradient) receives the gradient and
// may be x itself. Returns the loss.
template <class T>
double cross_entropy_row(const T* x, T* d, std::int64_t v, std::int64_t t, double grad_scale) {
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
  if (d != nullptr) {
    const T k = static_cast<T>(grad_scale / s);
    for (std::int64_t i = 0; i < v; ++i) d[i] *= k;
    d[t] -= static_cast<T>(grad_scale);
  }
  return static_cast<double>(m) + std::log(s) - xt;
}

// S: the logits' storage type, St: the losses', I: the targets'. 16-bit rows are widened into
// per-thread scratch, where the gradient is formed before it is rounded into dlogits.
template <class S, class St, class I>
std::int64_t cross_entropy_typed(const tensor& logits, const tensor& targets, const tensor& losses,
                                 const tensor& dlogits, double grad_scale,
                                 std::int64_t ignore_index) {
  const std::int64_t v = logits.size(-1);
  const std::int64_t n = v == 0 ? 0 : logits.numel() / v;
  const S* xp = static_cast<const S*>(logits.data());
  const I* tp = static_cast<const I*>(targets.data());
  St* lp = static_cast<St*>(losses.data());
  S* dp = dlogits.defined() ? static_cast<S*>(dlogits.data()) : nullptr;
  const std::int64_t counted = check_targets(tp, n, v, ignore_index);
  parallel::parallel_for(0, n, row_grain(v, exp_grain), [&](std::int64_t lo, std::int64_t hi) {
    // 16-bit: the row in f32, and its gradient in a separate row (no aliasing in the loops).
    float* row = is_half<S> ? thread_floats(static_cast<std::size_t>(2 * v)) : nullptr;
    for (std::int64_t r = lo; r < hi; ++r) {
      S* d = dp != nullptr ? dp + r * v : nullptr;
      const std::int64_t t = static_cast<std::int64_t>(tp[r]);
      if (t == ignore_index) {
        lp[r] = from_compute<St>(0);
        if (d != nullptr)
          for (std::int64_t i = 0; i < v; ++i) d[i] = from_compute<S>(0);
        continue;
      }
      double loss;
      if constexpr (is_half<S>) {
        widen_n(xp + r * v, row, v);
        loss = cross_entropy_row(row, d != nullptr ? row + v : nullptr, v, t, grad_scale);
        if (d != nullptr) narrow_n(row + v, d, v);
      } else {
        loss = cross_entropy_row(xp + r * v, d, v, t, grad_scale);
      }
      lp[r] = from_compute<St>(static_cast<compute_t<St>>(loss));
    }
  });
  return counted;
}

}  // namespace

std::int64_t cross_entropy(const tensor& logits, const tensor& targets, const tensor& losses,
                           const tensor& dlogits, double grad_scale, std::int64_t ignore_index) {
  return dispatch_floating("cross_entropy", logits.type(), [&]<class S>(S) -> std::int64_t {
    auto with_losses = [&]<class St>(St) -> std::int64_t {
      switch (targets.type()) {
        case dtype::i32:
          return cross_entropy_typed<S, St, std::int32_t>(logits, targets, losses, dlogits,
                                                          grad_scale, ignore_index);
        case dtype::i64:
          return cross_entropy_typed<S, St, std::int64_t>(logits, targets, losses, dlogits,
                                                          grad_scale, ignore_index);
        default:
          break;
      }
      TROUPE_FAIL("cpu cross_entropy: targets must be i32 or i64, got ",
                  dtype_name(targets.type()));
    };
    if constexpr (is_half<S>) {
      if (losses.type() == dtype::f32) return with_losses(float{});
    }
    return with_losses(S{});
  });
}

}  // namespace troupe::cpu
