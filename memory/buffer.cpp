#include "memory/buffer.hpp"

#include <cstdlib>
#include <new>

#include "memory/error.hpp"
#include "memory/gpu.hpp"

namespace troupe::memory {

buffer& buffer::operator=(buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    size_ = o.size_;
    tier_ = o.tier_;
    how_ = o.how_;
    o.data_ = nullptr;
    o.size_ = 0;
    o.how_ = how::none;
  }
  return *this;
}

buffer buffer::host(std::size_t bytes, std::size_t alignment) {
  TROUPE_CHECK(alignment >= 64 && (alignment & (alignment - 1)) == 0,
               "buffer::host: alignment must be a power of two >= 64, got ", alignment);
  std::size_t n = bytes == 0 ? alignment : (bytes + alignment - 1) / alignment * alignment;
  void* p = std::aligned_alloc(alignment, n);
  if (p == nullptr) TROUPE_FAIL("buffer::host: out of host memory allocating ", bytes, " bytes");
  account_alloc(tier::host, bytes);
  return buffer(p, bytes, tier::host, how::aligned);
}

buffer buffer::pinned(std::size_t bytes) {
  if (gpu_available()) {
    void* p = pinned_malloc(bytes == 0 ? 1 : bytes);
    account_alloc(tier::pinned, bytes);
    return buffer(p, bytes, tier::pinned, how::cuda_host);
  }
  std::size_t n = bytes == 0 ? 4096 : (bytes + 4095) / 4096 * 4096;
  void* p = std::aligned_alloc(4096, n);
  if (p == nullptr) TROUPE_FAIL("buffer::pinned: out of host memory allocating ", bytes, " bytes");
  account_alloc(tier::pinned, bytes);
  return buffer(p, bytes, tier::pinned, how::aligned);
}

buffer buffer::device(std::size_t bytes) {
  void* p = device_malloc(bytes == 0 ? 1 : bytes);
  account_alloc(tier::device, bytes);
  return buffer(p, bytes, tier::device, how::cuda_device);
}

void buffer::release() noexcept {
  if (data_ == nullptr) return;
  switch (how_) {
    case how::aligned:
      std::free(data_);
      break;
    case how::cuda_host:
      pinned_free(data_);
      break;
    case how::cuda_device:
      device_free(data_);
      break;
    case how::none:
      break;
  }
  account_free(tier_, size_);
  data_ = nullptr;
  size_ = 0;
  how_ = how::none;
}

}  // namespace troupe::memory
