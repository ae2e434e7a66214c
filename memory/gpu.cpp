#include "memory/gpu.hpp"

#include <cstring>
#include <mutex>

#include "memory/error.hpp"

#if defined(TROUPE_HAVE_CUDA)
#include <cuda_runtime_api.h>
#define TROUPE_CUDA_CHECK(expr)                                                     \
  do {                                                                              \
    cudaError_t e_ = (expr);                                                        \
    if (e_ != cudaSuccess) TROUPE_FAIL(#expr, " failed: ", cudaGetErrorString(e_)); \
  } while (0)
#endif

namespace troupe::memory {

#if defined(TROUPE_HAVE_CUDA)
bool cuda_built() {
  return true;
}

int gpu_count() {
  static int count = [] {
    int n = 0;  // left untouched on error
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();  // clear the sticky error
      return 0;
    }
    return n;
  }();
  return count;
}

void* device_malloc(std::size_t bytes) {
  TROUPE_CHECK(gpu_available(), "device memory requested but no GPU is available");
  void* p = nullptr;
  TROUPE_CUDA_CHECK(cudaMalloc(&p, bytes));
  return p;
}
void device_free(void* p) noexcept {
  (void)cudaFree(p);
}
void* pinned_malloc(std::size_t bytes) {
  void* p = nullptr;
  TROUPE_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocDefault));
  return p;
}
void pinned_free(void* p) noexcept {
  (void)cudaFreeHost(p);
}

void copy_bytes(void* dst, const void* src, std::size_t bytes, copy_kind kind) {
  if (kind == copy_kind::host_to_host) {
    std::memcpy(dst, src, bytes);
    return;
  }
  cudaMemcpyKind k = kind == copy_kind::host_to_device   ? cudaMemcpyHostToDevice
                     : kind == copy_kind::device_to_host ? cudaMemcpyDeviceToHost
                                                         : cudaMemcpyDeviceToDevice;
  TROUPE_CUDA_CHECK(cudaMemcpy(dst, src, bytes, k));
}
void device_synchronize() {
  TROUPE_CUDA_CHECK(cudaDeviceSynchronize());
}

#else
bool cuda_built() {
  return false;
}
int gpu_count() {
  return 0;
}
void* device_malloc(std::size_t) {
  TROUPE_FAIL("device memory requested but troupe was built without CUDA");
}
void device_free(void*) noexcept {}
void* pinned_malloc(std::size_t) {
  TROUPE_FAIL("cudaHostAlloc requested but troupe was built without CUDA");
}
void pinned_free(void*) noexcept {}
void copy_bytes(void* dst, const void* src, std::size_t bytes, copy_kind kind) {
  TROUPE_CHECK(kind == copy_kind::host_to_host,
               "device copy requested but troupe was built without CUDA");
  std::memcpy(dst, src, bytes);
}
void device_synchronize() {}
#endif

}  // namespace troupe::memory
