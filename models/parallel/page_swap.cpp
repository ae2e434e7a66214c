// page_swap: mremap-based exchange of two ranges' pages (see page_swap.hpp).
#include "models/parallel/page_swap.hpp"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "memory/error.hpp"

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

namespace troupe::models::parallel {

std::size_t page_size() {
  static const std::size_t n = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  return n;
}

mapped_pages::mapped_pages(std::size_t bytes) {
  const std::size_t pg = page_size();
  n_ = (bytes + pg - 1) / pg * pg;
  if (n_ == 0) return;
  void* p = ::mmap(nullptr, n_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TROUPE_CHECK(p != MAP_FAILED, "mapped_pages: mmap of ", n_,
               " bytes failed: ", std::strerror(errno));
  p_ = p;
}

mapped_pages::~mapped_pages() {
  if (p_ != nullptr) ::munmap(p_, n_);
}

mapped_pages& mapped_pages::operator=(mapped_pages&& o) noexcept {
  if (this != &o) {
    if (p_ != nullptr) ::munmap(p_, n_);
    p_ = o.p_;
    n_ = o.n_;
    o.p_ = nullptr;
    o.n_ = 0;
  }
  return *this;
}

namespace {

// Moves the pages of [from, from + n) onto [to, to + n), leaving `from` mapped and empty. The
// system call itself, not libc's mremap: UCX replaces mremap in the process with a hook for its
// memory registration cache, which does not keep MREMAP_DONTUNMAP's meaning (with it a launched
// pipeline run trained on moved-away activations).
// A failed move may already have unmapped `to` (the kernel unmaps a fixed destination before
// its last checks): `to` is then mapped again as fresh anonymous pages, so no range of ours is
// ever left a hole another mmap could take (its bytes are lost; the caller decides what that
// means).
bool move(void* from, void* to, std::size_t n) {
  const long r =
      ::syscall(SYS_mremap, from, n, n, MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP, to);
  if (r != -1 && reinterpret_cast<void*>(r) == to) return true;
  const int e = errno;
  if (::mmap(to, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) ==
      MAP_FAILED)
    TROUPE_FAIL("swap_pages: mremap of ", n, " bytes failed (", std::strerror(e),
                ") and its destination could not be mapped again: ", std::strerror(errno));
  errno = e;
  return false;
}

}  // namespace

bool swap_pages(void* a, void* b, void* tmp, std::size_t bytes) {
  if (bytes == 0) return true;
  TROUPE_CHECK(bytes % page_size() == 0, "swap_pages: ", bytes, " bytes is not whole pages");
  if (!move(a, tmp, bytes)) return false;  // nothing of a or b moved: the caller copies instead
  if (!move(b, a, bytes) || !move(tmp, b, bytes))
    TROUPE_FAIL("swap_pages: mremap of ", bytes, " bytes failed half way: ", std::strerror(errno));
  return true;
}

}  // namespace troupe::models::parallel
