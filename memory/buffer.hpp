// buffer: an owning, move-only block of bytes in one tier. Tensors are non-owning views over these.
#pragma once

#include <cstddef>

#include "memory/tier.hpp"

namespace troupe::memory {

class buffer {
 public:
  buffer() = default;
  ~buffer() { release(); }
  buffer(buffer&& o) noexcept { *this = static_cast<buffer&&>(o); }
  buffer& operator=(buffer&& o) noexcept;
  buffer(const buffer&) = delete;
  buffer& operator=(const buffer&) = delete;

  // Aligned host memory (alignment a power of two, at least 64). Contents are uninitialized.
  static buffer host(std::size_t bytes, std::size_t alignment = 64);
  // Page-locked host memory: cudaHostAlloc when a GPU is present, aligned (4 KiB) host memory
  // otherwise. Accounted as tier::pinned either way.
  static buffer pinned(std::size_t bytes);
  // Device memory on the current device. Throws troupe::error when there is no GPU or no CUDA
  // build.
  static buffer device(std::size_t bytes);
  // Host memory mapped in whole pages (mmap, anonymous, zero-filled), whose pages can be given
  // back to the system one range at a time with release_pages and come back, zeroed, when touched.
  static buffer host_pages(std::size_t bytes);

  // host_pages buffers: gives back the whole pages inside [offset, offset + bytes) (the partial
  // pages at either end stay) with madvise(MADV_DONTNEED): they read as zeros afterwards. Returns
  // the bytes given back; 0 for every other kind of buffer.
  std::size_t release_pages(std::size_t offset, std::size_t bytes);
  // host_pages buffers: the bytes of the buffer's pages resident in memory now (mincore); size()
  // for every other kind of buffer.
  std::size_t resident_bytes() const;

  void* data() const { return data_; }
  std::size_t size() const { return size_; }
  memory::tier where() const { return tier_; }
  explicit operator bool() const { return data_ != nullptr; }

 private:
  enum class how : unsigned char { none, aligned, mapped, cuda_host, cuda_device };
  buffer(void* p, std::size_t n, memory::tier t, how h) : data_(p), size_(n), tier_(t), how_(h) {}
  void release() noexcept;

  void* data_ = nullptr;
  std::size_t size_ = 0;
  memory::tier tier_ = memory::tier::host;
  how how_ = how::none;
};

}  // namespace troupe::memory
