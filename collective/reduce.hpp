// Element-wise reduction kernels the collective algorithms run on host memory.
//
// f32 and f64 reduce in their own type. bf16 and f16 are widened to f32, combined in f32 and
// rounded back to nearest even once, when a result leaves f32 (reduce_narrow, narrow): the
// algorithms keep 16-bit partial sums in f32 scratch (see algo.hpp), so an allreduce of 16-bit data
// rounds exactly once. avg is a sum divided by the divisor at the end (in f32 for 16-bit data).
// max follows the x86 maxps rule `a > b ? a : b` everywhere, vector body and scalar tail alike.
//
// The loops use AVX2 and F16C (this file is compiled with -march=x86-64-v3). Every kernel allows
// dst to alias an input exactly (in place), not to overlap it partially.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/communicator.hpp"
#include "tensor/dtype.hpp"

namespace troupe::collective {

// Types a reduction accepts: f32, f64, bf16, f16. Throws naming the op and the type otherwise.
void check_reducible(dtype t, const char* what);

// dst = a (op) b, for f32 or f64 (avg adds; divide afterwards).
void reduce_same(void* dst, const void* a, const void* b, std::size_t n, dtype t, reduce_op op);

// 16-bit h (bf16 or f16): dst (f32) = a (f32) (op) widen(b).
void reduce_widen(float* dst, const float* a, const std::uint16_t* b, std::size_t n, dtype h,
                  reduce_op op);
// dst (16-bit) = round((a (op) widen(b)) / divisor); divisor 1 divides nothing.
void reduce_narrow(std::uint16_t* dst, const float* a, const std::uint16_t* b, std::size_t n,
                   dtype h, reduce_op op, float divisor);

// dst (f32) = widen(src).
void widen(float* dst, const std::uint16_t* src, std::size_t n, dtype h);
// dst (16-bit) = round(src / divisor).
void narrow(std::uint16_t* dst, const float* src, std::size_t n, dtype h, float divisor);

// data /= divisor in place, for f32 or f64 (avg after a sum).
void divide(void* data, std::size_t n, dtype t, double divisor);

}  // namespace troupe::collective
