// Private helpers of the CUDA backend: return-code checks with file:line, dtype dispatch, launch
// sizes, 16-bit conversions, warp/block reductions, and the per-device cuBLAS handle and scratch.
//
// 16-bit numerics: bf16 and f16 are storage types. Kernels load them to f32, compute and
// accumulate in f32, and round each result once to the storage type (to nearest even).
//
// Every kernel runs on the current CUDA device (the one memory::buffer::device allocates on) and on
// the legacy default stream, so work stays ordered with cudaMemcpy and with other ops. Ops return
// with their work still queued; only ops that hand a value to the host (sum, sum_squares,
// all_finite, cross_entropy's count, embedding's id check) wait for the device.
#pragma once

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "memory/error.hpp"
#include "tensor/tensor.hpp"

#define TROUPE_CUDA_CHECK(expr)                                          \
  do {                                                                   \
    cudaError_t troupe_e_ = (expr);                                      \
    if (troupe_e_ != cudaSuccess)                                        \
      TROUPE_FAIL(#expr, " failed: ", cudaGetErrorName(troupe_e_), " (", \
                  cudaGetErrorString(troupe_e_), ")");                   \
  } while (0)

#define TROUPE_CUBLAS_CHECK(expr)                                        \
  do {                                                                   \
    cublasStatus_t troupe_s_ = (expr);                                   \
    if (troupe_s_ != CUBLAS_STATUS_SUCCESS)                              \
      TROUPE_FAIL(#expr, " failed: ", cublasGetStatusString(troupe_s_)); \
  } while (0)

// After a <<<...>>> launch: reports a bad launch configuration at the launch site. Faults inside a
// kernel surface at the next synchronizing call.
#define TROUPE_CUDA_CHECK_LAUNCH() TROUPE_CUDA_CHECK(cudaGetLastError())

// A grid-stride loop: for (std::int64_t i = ...; i < n; ...) over the whole launch.
#define TROUPE_GRID_STRIDE(i, n)                                                      \
  for (std::int64_t i = blockIdx.x * std::int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += std::int64_t{blockDim.x} * gridDim.x)

namespace troupe::cuda::detail {

inline constexpr int block_threads = 256;

// Blocks for a grid-stride loop over n items; grid-stride loops cover whatever the cap leaves.
inline unsigned grid_for(std::int64_t n, int threads = block_threads) {
  std::int64_t b = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<std::int64_t>(b, 1, 65536));
}

// ---- dtypes -----------------------------------------------------------------------------------
template <class T>
struct type_tag {
  using type = T;
};

// Calls f(type_tag<T>{}) with T = float, __nv_bfloat16 or __half; any other dtype is an error.
template <class F>
void dispatch_16_32(const char* op, const tensor& x, F&& f) {
  switch (x.type()) {
    case dtype::f32:
      f(type_tag<float>{});
      return;
    case dtype::bf16:
      f(type_tag<__nv_bfloat16>{});
      return;
    case dtype::f16:
      f(type_tag<__half>{});
      return;
    default:
      break;
  }
  TROUPE_FAIL("cuda ", op, ": dtype ", dtype_name(x.type()), " not supported");
}

// The dtype of the device type T (float, __nv_bfloat16 or __half).
template <class T>
inline constexpr dtype dtype_of_device = dtype::f32;
template <>
inline constexpr dtype dtype_of_device<__nv_bfloat16> = dtype::bf16;
template <>
inline constexpr dtype dtype_of_device<__half> = dtype::f16;

// Saved statistics of an op on T data (norm mean/rstd, attention lse, per-row losses) are stored
// as T or as f32: calls f(type_tag<S>{}) with S = T or float after the dtype of `stat`.
template <class T, class F>
void dispatch_stat(const char* op, const char* name, const tensor& stat, F&& f) {
  if (stat.type() == dtype::f32) {
    f(type_tag<float>{});
  } else if (stat.type() == dtype_of_device<T>) {
    f(type_tag<T>{});
  } else {
    TROUPE_FAIL("cuda ", op, ": ", name, " has dtype ", dtype_name(stat.type()),
                " but the data is ", dtype_name(dtype_of_device<T>), " (", name, " must be ",
                dtype_name(dtype_of_device<T>), " or f32)");
  }
}

inline void need_f32(const char* op, const tensor& x) {
  TROUPE_CHECK(x.type() == dtype::f32, "cuda ", op, ": dtype ", dtype_name(x.type()),
               " not supported (f32 only)");
}

template <class T>
T* ptr(const tensor& x) {
  return static_cast<T*>(x.data());
}

__device__ __forceinline__ float to_f32(float v) {
  return v;
}
__device__ __forceinline__ float to_f32(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
__device__ __forceinline__ float to_f32(__half v) {
  return __half2float(v);
}

template <class T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

// Rounds a value computed in f32 onto an element that already holds a value: x = round(x + v).
template <class T>
__device__ __forceinline__ void add_rounded(T& x, float v) {
  x = from_f32<T>(to_f32(x) + v);
}

// ---- reductions -------------------------------------------------------------------------------
template <class T>
__device__ __forceinline__ T warp_sum(T v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block; every thread gets the result. blockDim.x must be a multiple of 32 (at most
// 1024) and every thread of the block must call it. shared holds 32 values; it may be reused by
// the next call.
template <class T>
__device__ T block_sum(T v, T* shared) {
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // a previous call may still be reading shared
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? shared[lane] : T(0);
  return warp_sum(v);
}
__device__ inline float block_max(float v, float* shared) {
  v = warp_max(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x >> 5) ? shared[lane] : -INFINITY;
  return warp_max(v);
}

// ---- per-device state (context.cu) -----------------------------------------------------------
// The cuBLAS handle of the current device, created on first use on the default stream. Handles
// are never changed after creation, so threads may share them.
cublasHandle_t cublas_handle();

// Small device buffers for results that go back to the host, allocated once per device.
inline constexpr int max_partials = 1024;
struct scratch {
  double* partials = nullptr;  // [max_partials] per-block partial sums
  double* value = nullptr;     // [1] a reduced result
  long long* words = nullptr;  // [8] counters and flags
};
// Holds the lock for as long as the lease lives; ops keep it until their synchronizing copy back.
struct scratch_lease {
  std::unique_lock<std::mutex> lock;
  scratch* s = nullptr;
};
scratch_lease lease_scratch();

// A device buffer of at least n floats (grown on demand, kept per device), held under its own lock
// for as long as the lease lives. Kernels that use it run on the default stream, so the next
// lease's kernels start after the last one's have read it.
struct f32_scratch_lease {
  std::unique_lock<std::mutex> lock;
  float* p = nullptr;
};
f32_scratch_lease lease_f32_scratch(std::int64_t n);

}  // namespace troupe::cuda::detail
