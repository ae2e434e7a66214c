// TEMPORARY during parallel development: weak fallbacks replaced by real kernels.
#include "tensor/backend.hpp"
#include "memory/error.hpp"
namespace troupe::cpu {
__attribute__((weak)) void fill(const tensor& x, double value) { TROUPE_FAIL("cpu::fill not implemented yet"); }
__attribute__((weak)) void copy(const tensor& src, const tensor& dst) { TROUPE_FAIL("cpu::copy not implemented yet"); }
__attribute__((weak)) void add(const tensor& a, const tensor& b, const tensor& out) { TROUPE_FAIL("cpu::add not implemented yet"); }
__attribute__((weak)) void mul(const tensor& a, const tensor& b, const tensor& out) { TROUPE_FAIL("cpu::mul not implemented yet"); }
__attribute__((weak)) void axpy(double alpha, const tensor& x, const tensor& y) { TROUPE_FAIL("cpu::axpy not implemented yet"); }
__attribute__((weak)) void scale(const tensor& x, double alpha) { TROUPE_FAIL("cpu::scale not implemented yet"); }
__attribute__((weak)) void add_bias(const tensor& x, const tensor& bias) { TROUPE_FAIL("cpu::add_bias not implemented yet"); }
__attribute__((weak)) void sum_rows(const tensor& x, const tensor& out) { TROUPE_FAIL("cpu::sum_rows not implemented yet"); }
__attribute__((weak)) double sum(const tensor& x) { TROUPE_FAIL("cpu::sum not implemented yet"); }
__attribute__((weak)) double sum_squares(const tensor& x) { TROUPE_FAIL("cpu::sum_squares not implemented yet"); }
__attribute__((weak)) bool all_finite(const tensor& x) { TROUPE_FAIL("cpu::all_finite not implemented yet"); }
__attribute__((weak)) void gelu(const tensor& x, const tensor& y) { TROUPE_FAIL("cpu::gelu not implemented yet"); }
__attribute__((weak)) void gelu_backward(const tensor& x, const tensor& dy, const tensor& dx) { TROUPE_FAIL("cpu::gelu_backward not implemented yet"); }
__attribute__((weak)) void silu(const tensor& x, const tensor& y) { TROUPE_FAIL("cpu::silu not implemented yet"); }
__attribute__((weak)) void silu_backward(const tensor& x, const tensor& dy, const tensor& dx) { TROUPE_FAIL("cpu::silu_backward not implemented yet"); }
__attribute__((weak)) void swiglu(const tensor& gate, const tensor& up, const tensor& out) { TROUPE_FAIL("cpu::swiglu not implemented yet"); }
__attribute__((weak)) void swiglu_backward(const tensor& gate, const tensor& up, const tensor& dout, const tensor& dgate, const tensor& dup) { TROUPE_FAIL("cpu::swiglu_backward not implemented yet"); }
__attribute__((weak)) void softmax(const tensor& x, const tensor& y) { TROUPE_FAIL("cpu::softmax not implemented yet"); }
__attribute__((weak)) void softmax_backward(const tensor& y, const tensor& dy, const tensor& dx) { TROUPE_FAIL("cpu::softmax_backward not implemented yet"); }
__attribute__((weak)) void layernorm(const tensor& x, const tensor& w, const tensor& b, const tensor& y, const tensor& mean, const tensor& rstd, double eps) { TROUPE_FAIL("cpu::layernorm not implemented yet"); }
__attribute__((weak)) void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean, const tensor& rstd, const tensor& dx, const tensor& dw, const tensor& db) { TROUPE_FAIL("cpu::layernorm_backward not implemented yet"); }
__attribute__((weak)) void rmsnorm(const tensor& x, const tensor& w, const tensor& y, const tensor& rstd, double eps) { TROUPE_FAIL("cpu::rmsnorm not implemented yet"); }
__attribute__((weak)) void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd, const tensor& dx, const tensor& dw) { TROUPE_FAIL("cpu::rmsnorm_backward not implemented yet"); }
__attribute__((weak)) void rope_tables(std::int64_t start, double theta, const tensor& cos, const tensor& sin) { TROUPE_FAIL("cpu::rope_tables not implemented yet"); }
__attribute__((weak)) void rope(const tensor& x, const tensor& cos, const tensor& sin, const tensor& y, bool inverse) { TROUPE_FAIL("cpu::rope not implemented yet"); }
__attribute__((weak)) void embedding(const tensor& ids, const tensor& table, const tensor& out) { TROUPE_FAIL("cpu::embedding not implemented yet"); }
__attribute__((weak)) void embedding_backward(const tensor& ids, const tensor& dout, const tensor& dtable) { TROUPE_FAIL("cpu::embedding_backward not implemented yet"); }
__attribute__((weak)) std::int64_t cross_entropy(const tensor& logits, const tensor& targets, const tensor& losses, const tensor& dlogits, double grad_scale, std::int64_t ignore_index) { TROUPE_FAIL("cpu::cross_entropy not implemented yet"); }
__attribute__((weak)) void matmul(const tensor& a, const tensor& b, const tensor& c, double alpha, double beta) { TROUPE_FAIL("cpu::matmul not implemented yet"); }
__attribute__((weak)) void attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out, const tensor& lse, const ops::attention_options& opt) { TROUPE_FAIL("cpu::attention not implemented yet"); }
__attribute__((weak)) void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out, const tensor& dout, const tensor& lse, const tensor& dq, const tensor& dk, const tensor& dv, const ops::attention_options& opt) { TROUPE_FAIL("cpu::attention_backward not implemented yet"); }
__attribute__((weak)) void adamw(const tensor& param, const tensor& grad, const tensor& m, const tensor& v, const ops::adamw_options& opt) { TROUPE_FAIL("cpu::adamw not implemented yet"); }
}
namespace troupe::parallel {
__attribute__((weak)) void set_blas_threads(int) {}
}
