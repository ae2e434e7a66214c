// bf16 GEMM on Intel AMX (internal to tensor/cpu; gemm.cpp calls it for bf16 matmuls).
//
// AMX multiplies bf16 tiles into f32 accumulators (TDPBF16PS: products exact, sums in f32 with
// round to nearest even, subnormal inputs and outputs flushed to zero). On CPUs that have it (Xeon
// 4th generation and later) it runs the bf16 products several times faster than SGEMM on widened
// copies, with the same semantics: f32 accumulation, the result rounded once.
#pragma once

#include <cstdint>

#include "tensor/tensor.hpp"

namespace troupe::cpu {

// True when TROUPE_CPU_AMX is "1" (read on every call, so tests can switch it), this CPU has
// AMX-TILE and AMX-BF16, the OS keeps the tile state and the process was granted it.
//
// Opt-in: on the lent GPU machine's Xeon (16 vCPUs under Firecracker, 2026-11-28) bf16 training
// with this path gave wrong losses with 4, 8 and 16 threads (right with 2, the thread count it was
// developed at) and crashed once; the cause is not found. Until the "[amx]" test passes there at
// every thread count, bf16 products take the SGEMM-on-widened-panels path everywhere.
bool amx_bf16_usable();

// One operand as gemm.cpp describes it: element (r, c) at p[r * ld + c] (trans false) or at
// p[c * ld + r] (trans true).
struct bf16_operand {
  const bf16_t* p;
  bool trans;
  std::int64_t ld;
};

// c[m, n] = alpha * a[m, k] b[k, n] + beta * c, c rows ldc apart; k > 0.
void matmul_bf16_amx(bf16_operand a, bf16_operand b, bf16_t* c, std::int64_t ldc, std::int64_t m,
                     std::int64_t n, std::int64_t k, double alpha, double beta);

}  // namespace troupe::cpu
