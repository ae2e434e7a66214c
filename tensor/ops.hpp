// The tensor operations: one API, dispatched on the device of the arguments.
//
// Every op validates its arguments (device, dtype, shape, contiguity) here, before any backend
// runs, and throws troupe::error naming the op and the offending argument. Outputs are preallocated
// by the caller: no op allocates tensor memory. Backends: tensor/cpu (f32 and f64, and bf16/f16 for
// every op but adamw; vectorized and multi-threaded) and tensor/cuda (f32, plus bf16/f16 where
// noted; compiled when CUDA is found).
//
// Conventions:
// - Gradients of parameters accumulate (+=) so microbatches can add up; gradients of activations
//   are overwritten.
// - "rows" means all leading dimensions flattened: x[..., C] is viewed as [N, C].
// - Unless said otherwise, tensors must be contiguous and of one floating dtype.
// - bf16 and f16 tensors are storage types: an op loads them to f32, computes in f32 (sums in f32
//   or f64 as for f32 tensors) and rounds each result once to nearest even, as torch autocast
//   does. Parameter gradients accumulate the same way (load, add in f32, round).
// - Saved statistics (layernorm mean/rstd, rmsnorm rstd, attention lse, cross_entropy losses)
//   take the dtype of the input, or f32 when the input is bf16 or f16 (the more precise choice:
//   a bf16 lse near 8 is off by up to 2^-5, which backward turns into probabilities ~3% off).
#pragma once

#include <cstdint>

#include "tensor/tensor.hpp"

namespace troupe::ops {

// ---- data movement ---------------------------------------------------------------------------
void fill(const tensor& x, double value);
// dst = src elementwise for any strides and shapes of equal extents; converts between floating
// dtypes (f32 <-> f64/bf16/f16, rounding to nearest even). Same device only (see to_device).
void copy(const tensor& src, const tensor& dst);

// ---- elementwise -----------------------------------------------------------------------------
void add(const tensor& a, const tensor& b, const tensor& out);  // out = a + b (out may alias)
void mul(const tensor& a, const tensor& b, const tensor& out);  // out = a * b
void axpy(double alpha, const tensor& x, const tensor& y);      // y += alpha * x
void scale(const tensor& x, double alpha);                      // x *= alpha
void add_bias(const tensor& x, const tensor& bias);             // x[N,C] += bias[C]
void sum_rows(const tensor& x, const tensor& out);              // out[C] += sum over rows of x[N,C]
double sum(const tensor& x);                                    // f64 accumulation
double sum_squares(const tensor& x);                            // f64 accumulation
bool all_finite(const tensor& x);

// ---- activations -----------------------------------------------------------------------------
// GELU, tanh approximation (HF "gelu_new" / torch approximate="tanh").
void gelu(const tensor& x, const tensor& y);
void gelu_backward(const tensor& x, const tensor& dy, const tensor& dx);
void silu(const tensor& x, const tensor& y);
void silu_backward(const tensor& x, const tensor& dy, const tensor& dx);
// SwiGLU: out = silu(gate) * up.
void swiglu(const tensor& gate, const tensor& up, const tensor& out);
void swiglu_backward(const tensor& gate, const tensor& up, const tensor& dout, const tensor& dgate,
                     const tensor& dup);

// ---- softmax and normalization (over the last dimension) ------------------------------------
void softmax(const tensor& x, const tensor& y);
void softmax_backward(const tensor& y, const tensor& dy, const tensor& dx);
// y = (x - mean) * rstd * w + b; mean[N] and rstd[N] are saved for backward (dtype of x, or f32
// for 16-bit x; see Conventions).
// b may be undefined (no bias).
void layernorm(const tensor& x, const tensor& w, const tensor& b, const tensor& y,
               const tensor& mean, const tensor& rstd, double eps);
void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,
                        const tensor& rstd, const tensor& dx, const tensor& dw, const tensor& db);
// y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps).
void rmsnorm(const tensor& x, const tensor& w, const tensor& y, const tensor& rstd, double eps);
void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd,
                      const tensor& dx, const tensor& dw);

// ---- rotary position embedding (HF rotate-half convention) ----------------------------------
// The inverse frequencies of the tables (HF's rope_type, transformers' modeling_rope_utils.py):
// inv_i = theta^(-2i/D), i < D/2, then by `scaling`:
//   none    inv_i
//   linear  inv_i / factor
//   llama3  by the wavelength w_i = 2 pi / inv_i against the original context length L:
//           w_i > L / low_freq_factor: inv_i / factor; w_i < L / high_freq_factor: inv_i;
//           between, with s = (L / w_i - low_freq_factor) / (high_freq_factor - low_freq_factor):
//           (1 - s) inv_i / factor + s inv_i (continuous at both ends).
// HF's "dynamic" is a theta that depends on the sequence length: the caller passes that theta
// (models/layers/rope_scaling.hpp). f32 tables follow HF's float32 arithmetic step by step
// (tensor/rope_frequency.hpp); f64 tables evaluate the same formulas in double.
struct rope_options {
  enum class scaling { none, linear, llama3 };
  double theta = 10000.0;
  scaling type = scaling::none;
  double factor = 1.0;                  // linear, llama3: > 0
  double low_freq_factor = 1.0;         // llama3: > 0
  double high_freq_factor = 4.0;        // llama3: > low_freq_factor
  double original_max_position = 8192;  // llama3: L (original_max_position_embeddings), > 0
};
// cos/sin[T, D/2] for positions start..start+T-1: angle(t, i) = (start + t) * inv_i.
void rope_tables(std::int64_t start, const rope_options& opt, const tensor& cos, const tensor& sin);
// The same without scaling: angle(t, i) = (start + t) * theta^(-2i/D).
void rope_tables(std::int64_t start, double theta, const tensor& cos, const tensor& sin);
// x, y: [B, T, H, D] views (any strides, last dimension contiguous); y may alias x.
// y[..., :D/2] = x1*cos - x2*sin ; y[..., D/2:] = x2*cos + x1*sin.
// inverse = true applies the transpose rotation (the backward of the forward).
void rope(const tensor& x, const tensor& cos, const tensor& sin, const tensor& y,
          bool inverse = false);

// ---- embedding -------------------------------------------------------------------------------
// out[N, C] = table[ids[N]]; ids are i32 or i64 and checked against the table's rows.
void embedding(const tensor& ids, const tensor& table, const tensor& out);
void embedding_backward(const tensor& ids, const tensor& dout, const tensor& dtable);  // +=

// ---- fused softmax + cross-entropy ----------------------------------------------------------
// losses[N] = logsumexp(logits[n]) - logits[n, target[n]]; rows whose target == ignore_index get
// loss 0. If dlogits is defined: dlogits = (softmax(logits) - onehot(target)) * grad_scale (zero
// for ignored rows); dlogits may alias logits. Returns the number of rows not ignored.
std::int64_t cross_entropy(const tensor& logits, const tensor& targets, const tensor& losses,
                           const tensor& dlogits, double grad_scale,
                           std::int64_t ignore_index = -100);

// ---- GEMM -------------------------------------------------------------------------------------
// c = alpha * a @ b + beta * c for 2-D views. a and b may be transposed views (either of their
// strides may be 1); c must have a unit last stride. CPU: f32, f64 (OpenBLAS), and bf16/f16 with
// f32 accumulation and c rounded once (panels widened to f32 for OpenBLAS SGEMM;
// bf16 on Intel AMX with TROUPE_CPU_AMX=1, which flushes subnormals to zero: gemm_amx.hpp). CUDA:
// f32, and bf16/f16 inputs and output with f32 accumulation (cuBLAS).
void matmul(const tensor& a, const tensor& b, const tensor& c, double alpha = 1.0,
            double beta = 0.0);

// ---- attention -------------------------------------------------------------------------------
// Causal or full scaled-dot-product attention computed in tiles (flash-attention style: the
// T x S score matrix is never materialized; memory is linear in T).
// q[B, T, Hq, D], k and v [B, S, Hkv, D] with Hq % Hkv == 0 (grouped-query attention), out like q.
// Views with a contiguous last dimension (e.g. slices of a fused qkv buffer) are accepted.
// lse[B, Hq, T] (contiguous; dtype of q, or f32 for 16-bit q) receives the log-sum-exp of each
// query's scores, for backward. Causal: query t attends to keys s <= t + (S - T).
// segments (optional; packed rows of several documents): i32 [B, T] with S == T, contiguous,
// non-decreasing along T in each row; query t then also sees only keys s with segments[b, s] ==
// segments[b, t] (a document never attends to another). On the host for the CPU backend; the CUDA
// backend refuses it.
// kernel (CUDA only): tensor_cores takes the tensor-core kernels (attention_mma.cu) for bf16 and
// f16 with head dimension 64 or 128 on sm_80 and newer, the f32 CUDA-core kernels otherwise;
// cuda_cores always takes the latter. automatic is cuda_cores until the tensor-core kernels have
// passed their [gpu] tests on a GPU (they were written without one: docs/gpu.md).
enum class attention_kernel { automatic, cuda_cores, tensor_cores };
struct attention_options {
  double scale = 0.0;  // 0 means 1/sqrt(D)
  bool causal = true;
  tensor segments{};
  attention_kernel kernel = attention_kernel::automatic;
};
// The kernel attention and attention_backward run for q with opt: "cpu", "cuda tensor cores" or
// "cuda cores".
const char* attention_kernel_for(const tensor& q, const attention_options& opt = {});
void attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
               const tensor& lse, const attention_options& opt = {});
// dq, dk, dv (same shapes as q, k, v) are overwritten.
void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& dout, const tensor& lse, const tensor& dq, const tensor& dk,
                        const tensor& dv, const attention_options& opt = {});

// ---- optimizer -------------------------------------------------------------------------------
// torch.optim.AdamW for one tensor (f32): p -= lr*wd*p; m = b1*m + (1-b1)*g;
// v = b2*v + (1-b2)*g^2; p -= (lr / (1-b1^step)) * m / (sqrt(v / (1-b2^step)) + eps).
struct adamw_options {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.01;
  std::int64_t step = 1;  // 1-based step count after this update
};
void adamw(const tensor& param, const tensor& grad, const tensor& m, const tensor& v,
           const adamw_options& opt);

}  // namespace troupe::ops
