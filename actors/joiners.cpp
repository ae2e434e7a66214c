// Joiners of an elastic run (see joiners.hpp).
#include "actors/joiners.hpp"

namespace troupe::actors {

joiner_watch::joiner_watch(node& n) : n_(n) {
  callback_ = n.on_membership([q = q_](const member_event& e) {
    if (e.kind != member_event::joined) return;
    {
      std::lock_guard lk(q->mu);
      q->arrived.push_back({e.rank, std::chrono::steady_clock::now()});
    }
    q->cv.notify_all();
  });
}

joiner_watch::~joiner_watch() {
  if (callback_ >= 0) n_.remove_membership_callback(callback_);
}

std::vector<joiner_arrival> joiner_watch::take() {
  std::lock_guard lk(q_->mu);
  std::vector<joiner_arrival> out(q_->arrived.begin(), q_->arrived.end());
  q_->arrived.clear();
  return out;
}

bool joiner_watch::wait_until(std::chrono::steady_clock::time_point deadline) {
  std::unique_lock lk(q_->mu);
  return q_->cv.wait_until(lk, deadline, [&] { return !q_->arrived.empty(); });
}

}  // namespace troupe::actors
