// The few CUDA runtime services memory/ and its users need, behind a plain C++ header. Without a
// CUDA build, or on a machine without a GPU (driver missing: cudaErrorInsufficientDriver; no
// device: cudaErrorNoDevice), gpu_count() is 0 and the rest throw troupe::error.
#pragma once

#include <cstddef>

namespace troupe::memory {

bool cuda_built();  // compiled with the CUDA toolkit
int gpu_count();    // 0 when there is no usable GPU
inline bool gpu_available() {
  return gpu_count() > 0;
}

void* device_malloc(std::size_t bytes);
void device_free(void* p) noexcept;
void* pinned_malloc(std::size_t bytes);
void pinned_free(void* p) noexcept;

enum class copy_kind { host_to_device, device_to_host, device_to_device, host_to_host };
void copy_bytes(void* dst, const void* src, std::size_t bytes, copy_kind kind);
void device_synchronize();

}  // namespace troupe::memory
