// page_io: the ticket plumbing shared by every implementation (see page_io.hpp).
#include "memory/io/page_io.hpp"

namespace troupe::memory::io {

std::string_view backend_name(io_backend b) {
  return b == io_backend::io_uring ? "io_uring" : "pread";
}

std::string page_io::describe_backend() const {
  std::string s = std::string(backend_name(backend())) + ", " +
                  (direct_io() ? "O_DIRECT" : "buffered (no O_DIRECT)") + ", " + path();
  if (std::string note = backend_note(); !note.empty()) s += " (" + note + ")";
  return s;
}

io_ticket::io_ticket(io_ticket&& o) noexcept {
  *this = std::move(o);
}

io_ticket& io_ticket::operator=(io_ticket&& o) noexcept {
  if (this != &o) {
    release();
    owner_ = o.owner_;
    id_ = o.id_;
    o.owner_ = nullptr;
  }
  return *this;
}

io_ticket::~io_ticket() {
  release();
}

void io_ticket::release() noexcept {
  if (!owner_) return;
  page_io* o = owner_;
  owner_ = nullptr;
  o->ticket_release(id_);
}

void io_ticket::wait() {
  if (!owner_) return;
  page_io* o = owner_;
  owner_ = nullptr;
  o->ticket_wait(id_);
}

bool io_ticket::test() {
  return owner_ ? owner_->ticket_test(id_) : true;
}

}  // namespace troupe::memory::io
