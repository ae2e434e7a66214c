// rebindable_communicator (see rebindable_communicator.hpp).
#include "actors/rebindable_communicator.hpp"

#include <utility>

#include "memory/error.hpp"

namespace troupe::actors {

rebindable_communicator::rebindable_communicator(std::unique_ptr<collective::communicator> inner)
    : inner_(std::move(inner)) {
  TROUPE_CHECK(inner_ != nullptr, "rebindable_communicator: no communicator given");
}

rebindable_communicator::~rebindable_communicator() = default;

void rebindable_communicator::rebind(std::unique_ptr<collective::communicator> inner,
                                     bool any_shape) {
  TROUPE_CHECK(inner != nullptr, "rebindable_communicator: no communicator given");
  std::shared_ptr<collective::communicator> next(std::move(inner));
  std::shared_ptr<collective::communicator> old;
  {
    std::lock_guard lk(mu_);
    TROUPE_CHECK(any_shape || (next->rank() == inner_->rank() && next->size() == inner_->size()),
                 "rebindable_communicator: ", next->name(), " is rank ", next->rank(), " of ",
                 next->size(), ", but ", inner_->name(), " was rank ", inner_->rank(), " of ",
                 inner_->size());
    if (timeout_set_) next->set_timeout(timeout_);
    old = std::exchange(inner_, std::move(next));
  }
  // The old one goes here, outside the lock (its destructor joins its executor).
}

std::shared_ptr<collective::communicator> rebindable_communicator::current() const {
  std::lock_guard lk(mu_);
  return inner_;
}

void rebindable_communicator::before_next_reduction(std::function<void()> f) {
  std::lock_guard lk(mu_);
  reduction_hook_ = std::move(f);
}

void rebindable_communicator::run_reduction_hook() {
  std::function<void()> f;
  {
    std::lock_guard lk(mu_);
    f = std::exchange(reduction_hook_, nullptr);
  }
  if (f) f();
}

int rebindable_communicator::rank() const {
  return current()->rank();
}
int rebindable_communicator::size() const {
  return current()->size();
}
std::string rebindable_communicator::name() const {
  return current()->name();
}
collective::work rebindable_communicator::allreduce(void* data, std::size_t count, dtype t,
                                                    const collective::options& o) {
  run_reduction_hook();
  return current()->allreduce(data, count, t, o);
}
collective::work rebindable_communicator::reduce_scatter(const void* in, void* out,
                                                         std::size_t count, dtype t,
                                                         const collective::options& o) {
  run_reduction_hook();
  return current()->reduce_scatter(in, out, count, t, o);
}
collective::work rebindable_communicator::all_gather(const void* in, void* out, std::size_t count,
                                                     dtype t, const collective::options& o) {
  return current()->all_gather(in, out, count, t, o);
}
collective::work rebindable_communicator::broadcast(void* data, std::size_t count, dtype t,
                                                    const collective::options& o) {
  return current()->broadcast(data, count, t, o);
}
collective::work rebindable_communicator::all_to_all(const void* in, void* out, std::size_t count,
                                                     dtype t, const collective::options& o) {
  return current()->all_to_all(in, out, count, t, o);
}
collective::work rebindable_communicator::all_to_allv(const void* in,
                                                      std::span<const std::size_t> send_counts,
                                                      void* out,
                                                      std::span<const std::size_t> recv_counts,
                                                      dtype t, const collective::options& o) {
  return current()->all_to_allv(in, send_counts, out, recv_counts, t, o);
}
collective::work rebindable_communicator::send(const void* data, std::size_t count, dtype t,
                                               int peer, const collective::options& o) {
  return current()->send(data, count, t, peer, o);
}
collective::work rebindable_communicator::recv(void* data, std::size_t count, dtype t, int peer,
                                               const collective::options& o) {
  return current()->recv(data, count, t, peer, o);
}
collective::work rebindable_communicator::barrier(const collective::options& o) {
  return current()->barrier(o);
}
void rebindable_communicator::set_timeout(std::chrono::milliseconds timeout) {
  std::shared_ptr<collective::communicator> c;
  {
    std::lock_guard lk(mu_);
    timeout_ = timeout;
    timeout_set_ = true;
    c = inner_;
  }
  c->set_timeout(timeout);
}
void rebindable_communicator::abort(const std::string& reason) {
  current()->abort(reason);
}
std::vector<collective::flight_record> rebindable_communicator::recent() const {
  return current()->recent();
}

}  // namespace troupe::actors
