// nvme_store implementation (placeholder: the I/O engine lands in the next commit).
#include "memory/io/nvme_store.hpp"

#include "memory/error.hpp"

namespace troupe::memory::io {

std::string_view backend_name(io_backend b) {
  return b == io_backend::io_uring ? "io_uring" : "pread";
}

struct nvme_store::impl {};

io_ticket::io_ticket(io_ticket&& o) noexcept {
  *this = std::move(o);
}
io_ticket& io_ticket::operator=(io_ticket&& o) noexcept {
  if (this != &o) {
    release();
    store_ = o.store_;
    id_ = o.id_;
    o.store_ = nullptr;
  }
  return *this;
}
io_ticket::~io_ticket() {
  release();
}
void io_ticket::release() noexcept {
  store_ = nullptr;
}
void io_ticket::wait() {
  TROUPE_FAIL("nvme_store: not implemented yet");
}
bool io_ticket::test() {
  TROUPE_FAIL("nvme_store: not implemented yet");
}

nvme_store::nvme_store(nvme_store_options) {
  TROUPE_FAIL("nvme_store: not implemented yet");
}
nvme_store::~nvme_store() = default;

}  // namespace troupe::memory::io
