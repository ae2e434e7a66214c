// CUDA matmul: c = alpha * a @ b + beta * c on cuBLAS (cublasGemmEx, f32 accumulation) for f32,
// bf16 and f16 views; see gemm_plan.hpp for the row-major to column-major mapping.
//
// A 16-bit c with beta != 0 (gradient accumulation: dW += x^T dy) is rounded once: cuBLAS writes
// alpha * a @ b in f32 to a scratch buffer and a kernel adds beta * c in f32 and rounds to 16
// bits. Handing cuBLAS the 16-bit c instead was off by up to 15 bf16 ulps on an H200 (bf16
// 40x96x24, beta 1, where the sum cancels: alpha * a @ b rounded to bf16 before beta * c was
// added), with reduced-precision reductions disallowed (context.cu). With beta == 0 the epilogue
// rounds alpha * acc once.
#include <climits>

#include "tensor/backend.hpp"
#include "tensor/cuda/check.cuh"
#include "tensor/cuda/gemm_plan.hpp"

namespace troupe::cuda {
namespace {

using detail::from_f32;
using detail::to_f32;

cudaDataType_t cuda_type(dtype t) {
  switch (t) {
    case dtype::f32:
      return CUDA_R_32F;
    case dtype::bf16:
      return CUDA_R_16BF;
    case dtype::f16:
      return CUDA_R_16F;
    default:
      break;
  }
  TROUPE_FAIL("cuda matmul: dtype ", dtype_name(t), " not supported");
}

int as_int(std::int64_t v, const char* what) {
  TROUPE_CHECK(v <= INT_MAX, "cuda matmul: ", what, " = ", v, " exceeds cuBLAS's int range");
  return static_cast<int>(v);
}

// c[rows, cols] (row stride ldc) *= beta, or = 0 when beta == 0 (c is not read, as in BLAS).
template <class T>
__global__ void scale_rows_kernel(T* c, std::int64_t rows, std::int64_t cols, std::int64_t ldc,
                                  float beta) {
  TROUPE_GRID_STRIDE(k, rows * cols) {
    T* p = c + (k / cols) * ldc + k % cols;
    *p = from_f32<T>(beta == 0.0f ? 0.0f : to_f32(*p) * beta);
  }
}

// d (rows x cols, contiguous f32) + beta * c, rounded once into c (row stride ldc).
template <class T>
__global__ void add_scaled_rows_kernel(T* c, const float* d, std::int64_t rows, std::int64_t cols,
                                       std::int64_t ldc, float beta) {
  TROUPE_GRID_STRIDE(k, rows * cols) {
    T* p = c + (k / cols) * ldc + k % cols;
    *p = from_f32<T>(fmaf(beta, to_f32(*p), d[k]));
  }
}

}  // namespace

void matmul(const tensor& a, const tensor& b, const tensor& c, double alpha, double beta) {
  cudaDataType_t type = cuda_type(a.type());
  std::int64_t rows = c.size(0), cols = c.size(1);
  if (rows == 0 || cols == 0) return;
  gemm_plan p = plan_gemm(a, b, c);
  if (p.k == 0) {  // a @ b is all zeros: c = beta * c
    detail::dispatch_16_32("matmul", c, [&](auto tag) {
      using T = typename decltype(tag)::type;
      scale_rows_kernel<T><<<detail::grid_for(rows * cols), detail::block_threads>>>(
          detail::ptr<T>(c), rows, cols, p.ldc, static_cast<float>(beta));
      TROUPE_CUDA_CHECK_LAUNCH();
    });
    return;
  }
  const float alpha_f = static_cast<float>(alpha), beta_f = static_cast<float>(beta);
  if (type != CUDA_R_32F && beta != 0.0) {
    detail::f32_scratch_lease d = detail::lease_f32_scratch(rows * cols);
    const float zero = 0.0f;
    TROUPE_CUBLAS_CHECK(
        cublasGemmEx(detail::cublas_handle(), p.b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N,
                     p.a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N, as_int(p.m, "N"), as_int(p.n, "M"),
                     as_int(p.k, "K"), &alpha_f, b.data(), type, as_int(p.b.ld, "ldb"), a.data(),
                     type, as_int(p.a.ld, "lda"), &zero, d.p, CUDA_R_32F, as_int(cols, "N"),
                     CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    detail::dispatch_16_32("matmul", c, [&](auto tag) {
      using T = typename decltype(tag)::type;
      add_scaled_rows_kernel<T><<<detail::grid_for(rows * cols), detail::block_threads>>>(
          detail::ptr<T>(c), d.p, rows, cols, p.ldc, beta_f);
      TROUPE_CUDA_CHECK_LAUNCH();
    });
    return;
  }
  TROUPE_CUBLAS_CHECK(
      cublasGemmEx(detail::cublas_handle(), p.b.transpose ? CUBLAS_OP_T : CUBLAS_OP_N,
                   p.a.transpose ? CUBLAS_OP_T : CUBLAS_OP_N, as_int(p.m, "N"), as_int(p.n, "M"),
                   as_int(p.k, "K"), &alpha_f, b.data(), type, as_int(p.b.ld, "ldb"), a.data(),
                   type, as_int(p.a.ld, "lda"), &beta_f, c.data(), type, as_int(p.ldc, "ldc"),
                   CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace troupe::cuda
