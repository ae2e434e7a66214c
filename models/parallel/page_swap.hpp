// page_swap: exchange the memory pages behind two page-aligned host ranges instead of copying
// their bytes, so a pipeline stage can set a microbatch's activations aside and bring another's
// back into the arena in a few system calls (pipeline_stage.hpp's stash).
//
// swap_pages(a, b, tmp, n) moves a's pages to tmp, b's to a and tmp's (a's old ones) to b with
// mremap(MREMAP_DONTUNMAP): every range stays mapped throughout (a source left behind is empty,
// never a hole another thread's mmap could take), no byte is copied, and tmp ends empty. All
// three ranges must be private anonymous memory (malloc'd or mapped_pages), page aligned and n a
// multiple of the page size. It returns false, having changed nothing, when the kernel refuses
// the first move (a kernel before 5.7, a tool such as valgrind that does not know the flag): the
// caller then copies. A failure after the first move cannot be undone and throws. The moves
// bypass UCX's mremap hook (page_swap.cpp), so the ranges must hold no buffer a transport has
// registered: an unsharded stage's activation arena never goes to a communicator (the runner sends
// from its own pool; a tensor-parallel stage, whose collectives use its arena, copies instead), and
// only its whole interior pages move.
#pragma once

#include <cstddef>

namespace troupe::models::parallel {

std::size_t page_size();

// An anonymous private read-write mapping of whole pages, unmapped when destroyed.
class mapped_pages {
 public:
  mapped_pages() = default;
  explicit mapped_pages(std::size_t bytes);  // rounded up to whole pages
  ~mapped_pages();
  mapped_pages(mapped_pages&& o) noexcept : p_(o.p_), n_(o.n_) {
    o.p_ = nullptr;
    o.n_ = 0;
  }
  mapped_pages& operator=(mapped_pages&& o) noexcept;
  mapped_pages(const mapped_pages&) = delete;
  mapped_pages& operator=(const mapped_pages&) = delete;

  void* data() const { return p_; }
  std::size_t bytes() const { return n_; }

 private:
  void* p_ = nullptr;
  std::size_t n_ = 0;
};

bool swap_pages(void* a, void* b, void* tmp, std::size_t bytes);

}  // namespace troupe::models::parallel
