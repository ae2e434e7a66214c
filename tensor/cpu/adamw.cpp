// CPU backend: one AdamW step on one tensor, in the order torch.optim.AdamW (single-tensor,
// non-capturable path) uses:
//   p *= 1 - lr * wd;  m = lerp(m, g, 1 - b1);  v = b2 * v + (1 - b2) * g^2;
//   p -= (lr / (1 - b1^step)) * m / (sqrt(v) / sqrt(1 - b2^step) + eps).
// The scalar factors are computed in double and rounded once to the tensor's type.
#include <cmath>

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
    const bool lerp_low = w1 < T(0.5);  // torch.lerp's two formulas, chosen by the weight
    parallel::parallel_for(0, param.numel(), elem_grain, [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i) {
        const T gi = g[i];
        const T mi = lerp_low ? mp[i] + w1 * (gi - mp[i]) : gi - (gi - mp[i]) * (T(1) - w1);
        const T vi = b2 * vp[i] + w2 * gi * gi;
        mp[i] = mi;
        vp[i] = vi;
        p[i] = p[i] * decay - step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
      }
    });
  });
}

}  // namespace troupe::cpu
