#include "memory/buffer.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

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

namespace {
std::size_t page_size() {
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return page;
}
std::size_t whole_pages(std::size_t bytes) {
  return (std::max<std::size_t>(bytes, 1) + page_size() - 1) / page_size() * page_size();
}
}  // namespace

buffer buffer::host_pages(std::size_t bytes) {
  void* p = ::mmap(nullptr, whole_pages(bytes), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                   -1, 0);
  if (p == MAP_FAILED)
    TROUPE_FAIL("buffer::host_pages: mmap of ", bytes, " bytes failed: ", std::strerror(errno));
  account_alloc(tier::host, bytes);
  return buffer(p, bytes, tier::host, how::mapped);
}

std::size_t buffer::release_pages(std::size_t offset, std::size_t bytes) {
  if (how_ != how::mapped || bytes == 0) return 0;
  TROUPE_CHECK(offset <= size_ && bytes <= size_ - offset, "buffer::release_pages: [", offset,
               ", +", bytes, ") is outside the buffer of ", size_, " bytes");
  const std::size_t page = page_size();
  std::size_t begin = (offset + page - 1) / page * page, end = (offset + bytes) / page * page;
  if (begin >= end) return 0;
  if (::madvise(static_cast<char*>(data_) + begin, end - begin, MADV_DONTNEED) != 0)
    TROUPE_FAIL("buffer::release_pages: madvise(MADV_DONTNEED) of ", end - begin,
                " bytes failed: ", std::strerror(errno));
  return end - begin;
}

std::size_t buffer::resident_bytes() const {
  if (how_ != how::mapped) return size_;
  const std::size_t page = page_size(), n = whole_pages(size_) / page;
  std::vector<unsigned char> in(n);
  if (::mincore(data_, n * page, in.data()) != 0)
    TROUPE_FAIL("buffer::resident_bytes: mincore failed: ", std::strerror(errno));
  std::size_t resident = 0;
  for (unsigned char c : in) resident += (c & 1u) != 0 ? page : 0;
  return resident;
}

void buffer::release() noexcept {
  if (data_ == nullptr) return;
  switch (how_) {
    case how::aligned:
      std::free(data_);
      break;
    case how::mapped:
      ::munmap(data_, whole_pages(size_));
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
