// Backend entry points behind tensor/ops.hpp. Internal to tensor/: callers use troupe::ops.
// ops.cpp validates every argument first; a backend may assume shapes, devices and contiguity are
// right and only checks the dtypes it supports. The CPU and CUDA backends declare the same list,
// generated from TROUPE_BACKEND_OPS below.
#pragma once

#include <cstdint>

#include "tensor/ops.hpp"

#define TROUPE_BACKEND_OPS                                                                         \
  void fill(const tensor& x, double value);                                                        \
  void copy(const tensor& src, const tensor& dst);                                                 \
  void add(const tensor& a, const tensor& b, const tensor& out);                                   \
  void mul(const tensor& a, const tensor& b, const tensor& out);                                   \
  void axpy(double alpha, const tensor& x, const tensor& y);                                       \
  void scale(const tensor& x, double alpha);                                                       \
  void add_bias(const tensor& x, const tensor& bias);                                              \
  void sum_rows(const tensor& x, const tensor& out);                                               \
  double sum(const tensor& x);                                                                     \
  double sum_squares(const tensor& x);                                                             \
  bool all_finite(const tensor& x);                                                                \
  void gelu(const tensor& x, const tensor& y);                                                     \
  void gelu_backward(const tensor& x, const tensor& dy, const tensor& dx);                         \
  void silu(const tensor& x, const tensor& y);                                                     \
  void silu_backward(const tensor& x, const tensor& dy, const tensor& dx);                         \
  void swiglu(const tensor& gate, const tensor& up, const tensor& out);                            \
  void swiglu_backward(const tensor& gate, const tensor& up, const tensor& dout,                   \
                       const tensor& dgate, const tensor& dup);                                    \
  void softmax(const tensor& x, const tensor& y);                                                  \
  void softmax_backward(const tensor& y, const tensor& dy, const tensor& dx);                      \
  void layernorm(const tensor& x, const tensor& w, const tensor& b, const tensor& y,               \
                 const tensor& mean, const tensor& rstd, double eps);                              \
  void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,  \
                          const tensor& rstd, const tensor& dx, const tensor& dw,                  \
                          const tensor& db);                                                       \
  void rmsnorm(const tensor& x, const tensor& w, const tensor& y, const tensor& rstd, double eps); \
  void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd,    \
                        const tensor& dx, const tensor& dw);                                       \
  void rope_tables(std::int64_t start, const ops::rope_options& opt, const tensor& cos,            \
                   const tensor& sin);                                                             \
  void rope(const tensor& x, const tensor& cos, const tensor& sin, const tensor& y, bool inverse); \
  void embedding(const tensor& ids, const tensor& table, const tensor& out);                       \
  void embedding_backward(const tensor& ids, const tensor& dout, const tensor& dtable);            \
  std::int64_t cross_entropy(const tensor& logits, const tensor& targets, const tensor& losses,    \
                             const tensor& dlogits, double grad_scale, std::int64_t ignore_index); \
  void matmul(const tensor& a, const tensor& b, const tensor& c, double alpha, double beta);       \
  void attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,             \
                 const tensor& lse, const ops::attention_options& opt);                            \
  void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,    \
                          const tensor& dout, const tensor& lse, const tensor& dq,                 \
                          const tensor& dk, const tensor& dv, const ops::attention_options& opt);  \
  void adamw(const tensor& param, const tensor& grad, const tensor& m, const tensor& v,            \
             const ops::adamw_options& opt);

namespace troupe::cpu {
TROUPE_BACKEND_OPS
}  // namespace troupe::cpu

namespace troupe::cuda {
TROUPE_BACKEND_OPS
// ops::attention_kernel_for on a CUDA tensor (attention_mma.cu).
const char* attention_kernel_for(const tensor& q, const ops::attention_options& opt);
}  // namespace troupe::cuda
