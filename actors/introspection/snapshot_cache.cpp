// The refresher of snapshot_cache.hpp: one thread, woken by readers, one build at a time.
#include "actors/introspection/snapshot_cache.hpp"

#include <exception>
#include <utility>

#include "memory/error.hpp"

namespace troupe::actors {

snapshot_cache::snapshot_cache(std::function<job_snapshot()> provider,
                               std::vector<snapshot_view> views, std::chrono::milliseconds max_age)
    : provider_(std::move(provider)), views_(std::move(views)), max_age_(max_age) {
  TROUPE_CHECK(provider_, "snapshot cache: no snapshot provider given");
  TROUPE_CHECK(max_age_.count() >= 0, "snapshot cache: negative max age ", max_age_.count());
  thread_ = std::thread([this] { run(); });
}

snapshot_cache::~snapshot_cache() {
  stop();
}

void snapshot_cache::stop() {
  std::vector<waiter> dropped;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::lock_guard lock(mu_);
  dropped.swap(waiting_);  // destroyed after the lock is released
}

std::uint64_t snapshot_cache::builds() const {
  std::lock_guard lock(mu_);
  return builds_;
}

void snapshot_cache::get(clock::time_point asked, ready_fn ready) {
  std::shared_ptr<const rendered_snapshot> fresh;
  {
    std::lock_guard lock(mu_);
    if (latest_ && latest_->started >= asked - max_age_) {
      fresh = latest_;
    } else {
      if (stopping_) return;  // nobody will build it: the reader is dropped
      waiting_.push_back({asked, std::move(ready)});
      wake_.notify_one();
      return;
    }
  }
  ready(std::move(fresh));
}

void snapshot_cache::run() {
  std::unique_lock lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stopping_ || !waiting_.empty(); });
    if (stopping_) return;
    lock.unlock();

    auto r = std::make_shared<rendered_snapshot>();
    r->started = clock::now();
    try {
      job_snapshot s = provider_();
      for (const auto& v : views_) r->bodies[v.path] = v.render(s);
    } catch (const std::exception& e) {
      r->error = e.what();
      r->bodies.clear();
    } catch (...) {
      r->error = "unknown exception";
      r->bodies.clear();
    }

    // Serve everyone this build is fresh enough for; later readers wait for the next one.
    std::vector<waiter> served;
    lock.lock();
    ++builds_;
    latest_ = r;
    for (auto it = waiting_.begin(); it != waiting_.end();) {
      if (r->started >= it->asked - max_age_) {
        served.push_back(std::move(*it));
        it = waiting_.erase(it);
      } else {
        ++it;
      }
    }
    lock.unlock();
    for (auto& w : served) w.ready(r);
    served.clear();
    lock.lock();
  }
}

}  // namespace troupe::actors
