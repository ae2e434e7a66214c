// CUDA elementwise ops: add, mul, axpy, scale, add_bias, the activations (GELU tanh, SiLU, SwiGLU)
// and their backwards, for f32, bf16 and f16 (arithmetic in f32); AdamW for f32. Every element is
// read and written by one thread, so outputs may alias inputs.
#include <cmath>

#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"

namespace troupe::cuda {
namespace {

using detail::from_f32;
using detail::ptr;
using detail::to_f32;

template <class T, class Op>
__global__ void unary_kernel(const T* x, T* y, std::int64_t n, Op op) {
  TROUPE_GRID_STRIDE(i, n) {
    y[i] = from_f32<T>(op(to_f32(x[i])));
  }
}
template <class T, class Op>
__global__ void binary_kernel(const T* a, const T* b, T* y, std::int64_t n, Op op) {
  TROUPE_GRID_STRIDE(i, n) {
    y[i] = from_f32<T>(op(to_f32(a[i]), to_f32(b[i])));
  }
}

template <class Op>
void unary(const char* name, const tensor& x, const tensor& y, Op op) {
  detail::dispatch_16_32(name, x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::int64_t n = x.numel();
    if (n == 0) return;
    unary_kernel<T, Op>
        <<<detail::grid_for(n), detail::block_threads>>>(ptr<T>(x), ptr<T>(y), n, op);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}
template <class Op>
void binary(const char* name, const tensor& a, const tensor& b, const tensor& y, Op op) {
  detail::dispatch_16_32(name, a, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::int64_t n = a.numel();
    if (n == 0) return;
    binary_kernel<T, Op>
        <<<detail::grid_for(n), detail::block_threads>>>(ptr<T>(a), ptr<T>(b), ptr<T>(y), n, op);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

// ---- the maths --------------------------------------------------------------------------------
constexpr float gelu_k0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float gelu_k1 = 0.044715f;

__device__ __forceinline__ float gelu_f(float x) {
  float t = tanhf(gelu_k0 * (x + gelu_k1 * x * x * x));
  return 0.5f * x * (1.0f + t);
}
__device__ __forceinline__ float gelu_grad(float x) {
  float t = tanhf(gelu_k0 * (x + gelu_k1 * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * gelu_k0 * (1.0f + 3.0f * gelu_k1 * x * x);
}
__device__ __forceinline__ float sigmoid_f(float x) {
  return 1.0f / (1.0f + expf(-x));
}
__device__ __forceinline__ float silu_f(float x) {
  return x * sigmoid_f(x);
}
__device__ __forceinline__ float silu_grad(float x) {
  float s = sigmoid_f(x);
  return s * (1.0f + x * (1.0f - s));
}

struct add_op {
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct mul_op {
  __device__ float operator()(float a, float b) const { return a * b; }
};
struct axpy_op {  // (x, y) -> y + alpha * x
  float alpha;
  __device__ float operator()(float x, float y) const { return y + alpha * x; }
};
struct scale_op {
  float alpha;
  __device__ float operator()(float x) const { return x * alpha; }
};
struct gelu_op {
  __device__ float operator()(float x) const { return gelu_f(x); }
};
struct gelu_backward_op {  // (x, dy) -> dx
  __device__ float operator()(float x, float dy) const { return dy * gelu_grad(x); }
};
struct silu_op {
  __device__ float operator()(float x) const { return silu_f(x); }
};
struct silu_backward_op {
  __device__ float operator()(float x, float dy) const { return dy * silu_grad(x); }
};
struct swiglu_op {  // (gate, up) -> silu(gate) * up
  __device__ float operator()(float g, float u) const { return silu_f(g) * u; }
};

template <class T>
__global__ void swiglu_backward_kernel(const T* gate, const T* up, const T* dout, T* dgate, T* dup,
                                       std::int64_t n) {
  TROUPE_GRID_STRIDE(i, n) {
    float g = to_f32(gate[i]), u = to_f32(up[i]), d = to_f32(dout[i]);
    dgate[i] = from_f32<T>(d * u * silu_grad(g));
    dup[i] = from_f32<T>(d * silu_f(g));
  }
}

template <class T>
__global__ void add_bias_kernel(T* x, const T* bias, std::int64_t n, std::int64_t c) {
  TROUPE_GRID_STRIDE(i, n) {
    x[i] = from_f32<T>(to_f32(x[i]) + to_f32(bias[i % c]));
  }
}

// The CPU backend's step (tensor/cpu/adamw.cpp), rounding for rounding: the scalar factors are
// computed in double on the host and rounded once to f32, m and v each in one fused multiply-add,
// everything else rounded per operation (the _rn intrinsics keep nvcc from contracting them into
// other fused multiply-adds; division and sqrt are IEEE without --use_fast_math).
struct adamw_args {
  float decay;      // 1 - lr * weight_decay
  float w1, b1;     // 1 - beta1, and 1 - that (torch.lerp's second formula)
  float b2, w2;     // beta2, 1 - beta2
  float step_size;  // lr / (1 - beta1^step)
  float bc2_sqrt;   // sqrt(1 - beta2^step)
  float eps;
  bool lerp_low;  // w1 < 0.5: torch.lerp's first formula
};
__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, std::int64_t n,
                             adamw_args a) {
  TROUPE_GRID_STRIDE(i, n) {
    const float gi = g[i], mo = m[i];
    const float d = __fsub_rn(gi, mo);
    const float mi = a.lerp_low ? fmaf(d, a.w1, mo) : fmaf(-d, a.b1, gi);
    const float vi = fmaf(a.b2, v[i], __fmul_rn(__fmul_rn(a.w2, gi), gi));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), a.bc2_sqrt), a.eps);
    p[i] = __fsub_rn(__fmul_rn(p[i], a.decay), __fdiv_rn(__fmul_rn(a.step_size, mi), denom));
  }
}

}  // namespace

void add(const tensor& a, const tensor& b, const tensor& out) {
  binary("add", a, b, out, add_op{});
}
void mul(const tensor& a, const tensor& b, const tensor& out) {
  binary("mul", a, b, out, mul_op{});
}
void axpy(double alpha, const tensor& x, const tensor& y) {
  binary("axpy", x, y, y, axpy_op{static_cast<float>(alpha)});
}
void scale(const tensor& x, double alpha) {
  unary("scale", x, x, scale_op{static_cast<float>(alpha)});
}

void add_bias(const tensor& x, const tensor& bias) {
  detail::dispatch_16_32("add_bias", x, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::int64_t n = x.numel(), c = bias.numel();
    if (n == 0) return;
    add_bias_kernel<T>
        <<<detail::grid_for(n), detail::block_threads>>>(ptr<T>(x), ptr<T>(bias), n, c);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void gelu(const tensor& x, const tensor& y) {
  unary("gelu", x, y, gelu_op{});
}
void gelu_backward(const tensor& x, const tensor& dy, const tensor& dx) {
  binary("gelu_backward", x, dy, dx, gelu_backward_op{});
}
void silu(const tensor& x, const tensor& y) {
  unary("silu", x, y, silu_op{});
}
void silu_backward(const tensor& x, const tensor& dy, const tensor& dx) {
  binary("silu_backward", x, dy, dx, silu_backward_op{});
}
void swiglu(const tensor& gate, const tensor& up, const tensor& out) {
  binary("swiglu", gate, up, out, swiglu_op{});
}
void swiglu_backward(const tensor& gate, const tensor& up, const tensor& dout, const tensor& dgate,
                     const tensor& dup) {
  detail::dispatch_16_32("swiglu_backward", gate, [&](auto tag) {
    using T = typename decltype(tag)::type;
    std::int64_t n = gate.numel();
    if (n == 0) return;
    swiglu_backward_kernel<T><<<detail::grid_for(n), detail::block_threads>>>(
        ptr<T>(gate), ptr<T>(up), ptr<T>(dout), ptr<T>(dgate), ptr<T>(dup), n);
    TROUPE_CUDA_CHECK_LAUNCH();
  });
}

void adamw(const tensor& param, const tensor& grad, const tensor& m, const tensor& v,
           const ops::adamw_options& opt) {
  detail::need_f32("adamw", param);
  std::int64_t n = param.numel();
  if (n == 0) return;
  double t = static_cast<double>(opt.step);
  adamw_args a;
  a.decay = static_cast<float>(1.0 - opt.lr * opt.weight_decay);
  a.w1 = static_cast<float>(1.0 - opt.beta1);
  a.b1 = 1.0f - a.w1;
  a.b2 = static_cast<float>(opt.beta2);
  a.w2 = static_cast<float>(1.0 - opt.beta2);
  a.step_size = static_cast<float>(opt.lr / (1.0 - std::pow(opt.beta1, t)));
  a.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(opt.beta2, t)));
  a.eps = static_cast<float>(opt.eps);
  a.lerp_low = a.w1 < 0.5f;
  adamw_kernel<<<detail::grid_for(n), detail::block_threads>>>(ptr<float>(param), ptr<float>(grad),
                                                               ptr<float>(m), ptr<float>(v), n, a);
  TROUPE_CUDA_CHECK_LAUNCH();
}

}  // namespace troupe::cuda
