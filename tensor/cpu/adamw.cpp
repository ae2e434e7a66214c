// CPU backend: one AdamW step on one tensor, in the order torch.optim.AdamW (single-tensor,
// non-capturable path) uses:
//   p *= 1 - lr * wd;  m = lerp(m, g, 1 - b1);  v = b2 * v + (1 - b2) * g^2;
//   p -= (lr / (1 - b1^step)) * m / (sqrt(v) / sqrt(1 - b2^step) + eps).
// The scalar factors are computed in double and rounded once to the tensor's type. The loop's
// roundings are spelled out: m and v each in one fused multiply-add (what GCC's contraction made
// of the scalar loop on x86-64-v3), everything else rounded per operation; the file is built
// without contraction (tensor/CMakeLists.txt), so the vector body and the scalar tail agree.
#include <cmath>
#include <type_traits>

#include "tensor/backend.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {

void adamw(const tensor& param, const tensor& grad, const tensor& m, const tensor& v,
           const ops::adamw_options& opt) {
  dispatch_float("adamw", param.type(), [&]<class T>(T) {
    T* p = static_cast<T*>(param.data());
    const T* g = static_cast<const T*>(grad.data());
    T* mp = static_cast<T*>(m.data());
    T* vp = static_cast<T*>(v.data());
    const double step = static_cast<double>(opt.step);
    const T decay = static_cast<T>(1.0 - opt.lr * opt.weight_decay);
    const T w1 = static_cast<T>(1.0 - opt.beta1);
    const T b2 = static_cast<T>(opt.beta2);
    const T w2 = static_cast<T>(1.0 - opt.beta2);
    const T step_size = static_cast<T>(opt.lr / (1.0 - std::pow(opt.beta1, step)));
    const T bc2_sqrt = static_cast<T>(std::sqrt(1.0 - std::pow(opt.beta2, step)));
    const T eps = static_cast<T>(opt.eps);
    // torch.lerp's two formulas, chosen by the weight: a loop for each, over local copies of
    // the pointers and factors, so that the compiler vectorizes it (no branch or reloads inside;
    // the file is built with -fno-math-errno for the sqrt).
    auto run = [&]<bool lerp_low>(std::bool_constant<lerp_low>) {
      parallel::parallel_for(0, param.numel(), elem_grain, [&](std::int64_t lo, std::int64_t hi) {
        T* __restrict pl = p;
        const T* __restrict gl = g;
        T* __restrict ml = mp;
        T* __restrict vl = vp;
        const T d = decay, a1 = w1, c2 = b2, a2 = w2, s = step_size, bc = bc2_sqrt, e = eps;
        const T b1 = T(1) - a1;
        for (std::int64_t i = lo; i < hi; ++i) {
          const T gi = gl[i];
          const T mi = lerp_low ? std::fma(gi - ml[i], a1, ml[i]) : std::fma(-(gi - ml[i]), b1, gi);
          const T vi = std::fma(c2, vl[i], a2 * gi * gi);
          ml[i] = mi;
          vl[i] = vi;
          pl[i] = pl[i] * d - s * mi / (std::sqrt(vi) / bc + e);
        }
      });
    };
    if (w1 < T(0.5))
      run(std::true_type{});
    else
      run(std::false_type{});
  });
}

}  // namespace troupe::cpu
