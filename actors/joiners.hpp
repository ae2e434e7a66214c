// Joiners of an elastic run (troupe launch --join): new processes that took lost ranks' places in
// the membership (node's member_event::joined). The driver (actors/training.cpp) hears of them
// here, from a membership callback, and admits each as a spare at the next step boundary or while
// a recovery waits for one (elastic.join_wait).
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "actors/node.hpp"

namespace troupe::actors {

struct joiner_arrival {
  int rank = -1;
  std::chrono::steady_clock::time_point at;  // when the driver heard of it
};

// Watches `n`'s membership from construction to destruction (the callback is removed then).
class joiner_watch {
 public:
  explicit joiner_watch(node& n);
  ~joiner_watch();
  joiner_watch(const joiner_watch&) = delete;
  joiner_watch& operator=(const joiner_watch&) = delete;

  // The joiners heard of since the last call, in arrival order (without waiting).
  std::vector<joiner_arrival> take();
  // Waits until a joiner not yet taken arrived or `deadline` passed; whether one did.
  bool wait_until(std::chrono::steady_clock::time_point deadline);

 private:
  struct queue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<joiner_arrival> arrived;
  };
  node& n_;
  std::shared_ptr<queue> q_ = std::make_shared<queue>();
  int callback_ = -1;
};

}  // namespace troupe::actors
