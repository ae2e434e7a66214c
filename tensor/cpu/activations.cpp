// CPU backend: GELU (tanh approximation), SiLU and SwiGLU with their backward passes.
//
// GELU uses 0.5 * (1 + tanh(u)) = sigmoid(2u), so gelu(x) = x * sigmoid(2u) with
// u = sqrt(2/pi) * (x + 0.044715 x^3): one exp, no cancellation near 0, and the right limits for
// large |x| (exp overflowing to inf gives exactly 0 or x).
#include <cmath>

#include "tensor/backend.hpp"
#include "tensor/cpu/fast_math.hpp"
#include "tensor/cpu/half.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {
namespace {

template <class T>
inline constexpr T gelu_k0 = static_cast<T>(0.79788456080286535587989211986876);  // sqrt(2/pi)
template <class T>
inline constexpr T gelu_k1 = static_cast<T>(0.044715);

template <class T>
inline T gelu_value(T x) {
  T u = gelu_k0<T> * (x + gelu_k1<T> * x * x * x);
  return x * sigmoid(T(2) * u);
}

// d/dx of 0.5 x (1 + tanh u) = s + 2 x s (1 - s) u' with s = sigmoid(2u), since
// 1 - tanh(u)^2 = 4 s (1 - s).
template <class T>
inline T gelu_grad(T x) {
  T x2 = x * x;
  T u = gelu_k0<T> * (x + gelu_k1<T> * x2 * x);
  T du = gelu_k0<T> * (T(1) + T(3) * gelu_k1<T> * x2);
  T s = sigmoid(T(2) * u);
  return s + T(2) * x * s * (T(1) - s) * du;
}

}  // namespace

// Every body below is written once for the compute type C (f32 for bf16 and f16 storage, whose
// results are rounded once: map_elements in half.hpp).

void gelu(const tensor& x, const tensor& y) {
  dispatch_floating("gelu", x.type(), [&]<class S>(S) {
    map_elements(
        x.numel(), exp_grain, static_cast<S*>(y.data()), [](auto v) { return gelu_value(v); },
        static_cast<const S*>(x.data()));
  });
}

void gelu_backward(const tensor& x, const tensor& dy, const tensor& dx) {
  dispatch_floating("gelu_backward", x.type(), [&]<class S>(S) {
    map_elements(
        x.numel(), exp_grain, static_cast<S*>(dx.data()),
        [](auto xi, auto gi) { return gi * gelu_grad(xi); }, static_cast<const S*>(x.data()),
        static_cast<const S*>(dy.data()));
  });
}

void silu(const tensor& x, const tensor& y) {
  dispatch_floating("silu", x.type(), [&]<class S>(S) {
    map_elements(
        x.numel(), exp_grain, static_cast<S*>(y.data()), [](auto v) { return v * sigmoid(v); },
        static_cast<const S*>(x.data()));
  });
}

// silu'(x) = s (1 + x (1 - s)) with s = sigmoid(x).
void silu_backward(const tensor& x, const tensor& dy, const tensor& dx) {
  dispatch_floating("silu_backward", x.type(), [&]<class S>(S) {
    using C = compute_t<S>;
    map_elements(
        x.numel(), exp_grain, static_cast<S*>(dx.data()),
        [](C xi, C gi) {
          C s = sigmoid(xi);
          return gi * s * (C(1) + xi * (C(1) - s));
        },
        static_cast<const S*>(x.data()), static_cast<const S*>(dy.data()));
  });
}

void swiglu(const tensor& gate, const tensor& up, const tensor& o) {
  dispatch_floating("swiglu", gate.type(), [&]<class S>(S) {
    map_elements(
        gate.numel(), exp_grain, static_cast<S*>(o.data()),
        [](auto g, auto u) { return g * sigmoid(g) * u; }, static_cast<const S*>(gate.data()),
        static_cast<const S*>(up.data()));
  });
}

// dgate = dout * up * silu'(gate), dup = dout * silu(gate).
void swiglu_backward(const tensor& gate, const tensor& up, const tensor& dout, const tensor& dgate,
                     const tensor& dup) {
  dispatch_floating("swiglu_backward", gate.type(), [&]<class S>(S) {
    using C = compute_t<S>;
    map_elements2(
        gate.numel(), exp_grain, static_cast<S*>(dgate.data()), static_cast<S*>(dup.data()),
        [](auto& dg, auto& du, C gi, C ui, C di) {
          C s = sigmoid(gi);
          dg = di * ui * s * (C(1) + gi * (C(1) - s));
          du = di * gi * s;
        },
        static_cast<const S*>(gate.data()), static_cast<const S*>(up.data()),
        static_cast<const S*>(dout.data()));
  });
}

}  // namespace troupe::cpu
