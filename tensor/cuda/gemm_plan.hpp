// How a row-major GEMM c = a @ b over strided 2-D views maps onto a column-major BLAS call.
//
// Read as column-major with leading dimension ldc, the bytes of row-major c[M, N] are c^T, and
// c^T = b^T a^T: so the call is gemm(op_b, op_a, m = N, n = M, k = K, b, a, c). A view whose rows
// are contiguous (unit last stride) read as column-major is already its own transpose (op N, ld =
// row stride); a transposed view (unit first stride) needs op T with ld = column stride. Plain C++
// (no CUDA) so that it is tested without a GPU.
#pragma once

#include <algorithm>
#include <cstdint>

#include "memory/error.hpp"
#include "tensor/tensor.hpp"

namespace troupe::cuda {

struct gemm_operand {
  bool transpose = false;  // op T (else op N) in the column-major call
  std::int64_t ld = 1;
};

struct gemm_plan {
  std::int64_t m = 0, n = 0, k = 0;  // of the column-major call: m = N, n = M, k = K
  gemm_operand b;                    // the first operand of the call
  gemm_operand a;                    // the second operand of the call
  std::int64_t ldc = 1;
};

// x[rows, cols] as the column-major operand that stands for x^T.
inline gemm_operand gemm_operand_for(const char* name, const tensor& x) {
  std::int64_t rows = x.size(0), cols = x.size(1);
  if (x.stride(1) == 1 || cols <= 1) {  // rows contiguous: x^T as column-major, op N
    std::int64_t ld = rows <= 1 ? std::max<std::int64_t>(1, cols) : x.stride(0);
    if (ld >= std::max<std::int64_t>(1, cols)) return {false, ld};
  }
  if (x.stride(0) == 1 || rows <= 1) {  // columns contiguous: x as column-major, op T
    std::int64_t ld = cols <= 1 ? std::max<std::int64_t>(1, rows) : x.stride(1);
    if (ld >= std::max<std::int64_t>(1, rows)) return {true, ld};
  }
  TROUPE_FAIL("cuda matmul: ", name, " has strides cuBLAS cannot express: ", x.describe());
}

inline gemm_plan plan_gemm(const tensor& a, const tensor& b, const tensor& c) {
  gemm_plan p;
  p.m = c.size(1);
  p.n = c.size(0);
  p.k = a.size(1);
  p.b = gemm_operand_for("b", b);
  p.a = gemm_operand_for("a", a);
  p.ldc = c.size(0) <= 1 ? std::max<std::int64_t>(1, c.size(1)) : c.stride(0);
  TROUPE_CHECK(p.ldc >= std::max<std::int64_t>(1, c.size(1)),
               "cuda matmul: c rows overlap: ", c.describe());
  return p;
}

}  // namespace troupe::cuda
