// CPU backend: GELU (tanh approximation), SiLU and SwiGLU with their backward passes.
//
// GELU uses 0.5 * (1 + tanh(u)) = sigmoid(2u), so gelu(x) = x * sigmoid(2u) with
// u = sqrt(2/pi) * (x + 0.044715 x^3): one exp, no cancellation near 0, and the right limits for
// large |x| (exp overflowing to inf gives exactly 0 or x).
#include <cmath>

#include "tensor/backend.hpp"
#include "tensor/cpu/fast_math.hpp"
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

// Runs body(i) for every i in [0, n) on the thread pool.
template <class F>
void for_each(std::int64_t n, F&& body) {
  parallel::parallel_for(0, n, exp_grain, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t i = lo; i < hi; ++i) body(i);
  });
}

template <class T>
const T* in(const tensor& t) {
  return static_cast<const T*>(t.data());
}
template <class T>
T* out(const tensor& t) {
  return static_cast<T*>(t.data());
}

}  // namespace

void gelu(const tensor& x, const tensor& y) {
  dispatch_float("gelu", x.type(), [&]<class T>(T) {
    const T* xp = in<T>(x);
    T* yp = out<T>(y);
    for_each(x.numel(), [&](std::int64_t i) { yp[i] = gelu_value(xp[i]); });
  });
}

void gelu_backward(const tensor& x, const tensor& dy, const tensor& dx) {
  dispatch_float("gelu_backward", x.type(), [&]<class T>(T) {
    const T* xp = in<T>(x);
    const T* g = in<T>(dy);
    T* d = out<T>(dx);
    for_each(x.numel(), [&](std::int64_t i) { d[i] = g[i] * gelu_grad(xp[i]); });
  });
}

void silu(const tensor& x, const tensor& y) {
  dispatch_float("silu", x.type(), [&]<class T>(T) {
    const T* xp = in<T>(x);
    T* yp = out<T>(y);
    for_each(x.numel(), [&](std::int64_t i) { yp[i] = xp[i] * sigmoid(xp[i]); });
  });
}

// silu'(x) = s (1 + x (1 - s)) with s = sigmoid(x).
void silu_backward(const tensor& x, const tensor& dy, const tensor& dx) {
  dispatch_float("silu_backward", x.type(), [&]<class T>(T) {
    const T* xp = in<T>(x);
    const T* g = in<T>(dy);
    T* d = out<T>(dx);
    for_each(x.numel(), [&](std::int64_t i) {
      T s = sigmoid(xp[i]);
      d[i] = g[i] * s * (T(1) + xp[i] * (T(1) - s));
    });
  });
}

void swiglu(const tensor& gate, const tensor& up, const tensor& o) {
  dispatch_float("swiglu", gate.type(), [&]<class T>(T) {
    const T* g = in<T>(gate);
    const T* u = in<T>(up);
    T* op = out<T>(o);
    for_each(gate.numel(), [&](std::int64_t i) { op[i] = g[i] * sigmoid(g[i]) * u[i]; });
  });
}

// dgate = dout * up * silu'(gate), dup = dout * silu(gate).
void swiglu_backward(const tensor& gate, const tensor& up, const tensor& dout, const tensor& dgate,
                     const tensor& dup) {
  dispatch_float("swiglu_backward", gate.type(), [&]<class T>(T) {
    const T* g = in<T>(gate);
    const T* u = in<T>(up);
    const T* d = in<T>(dout);
    T* dg = out<T>(dgate);
    T* du = out<T>(dup);
    for_each(gate.numel(), [&](std::int64_t i) {
      T gi = g[i], ui = u[i], di = d[i];
      T s = sigmoid(gi);
      dg[i] = di * ui * s * (T(1) + gi * (T(1) - s));
      du[i] = di * gi * s;
    });
  });
}

}  // namespace troupe::cpu
