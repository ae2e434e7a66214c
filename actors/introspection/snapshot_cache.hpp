// The rendered snapshot pages of the introspection endpoint, built off the server thread.
//
// A refresher thread calls the provider (the coordinator's snapshot: a request to every member)
// and renders every view of it (JSON, Prometheus text, the page) into one immutable
// `rendered_snapshot`, shared by all readers. A reader asks for a snapshot no older than
// `max_age` before its request came: a fresh enough one is handed over at once; otherwise the
// reader waits (a callback, never a blocked thread) for the next build, which serves every reader
// waiting then. So the server thread only copies ready bytes, a slow provider holds up only the
// readers of snapshot pages, and many readers cost one build per `max_age` at most.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "actors/introspection/snapshot.hpp"

namespace troupe::actors {

// One page rendered from each snapshot: its path, content type and renderer.
struct snapshot_view {
  std::string path;
  std::string content_type;
  std::function<std::string(const job_snapshot&)> render;
};

struct rendered_snapshot {
  std::chrono::steady_clock::time_point started;  // when the provider was called
  std::string error;  // not empty: the provider or a renderer threw, with this message
  std::map<std::string, std::string> bodies;  // by view path
};

class snapshot_cache {
 public:
  using clock = std::chrono::steady_clock;
  using ready_fn = std::function<void(std::shared_ptr<const rendered_snapshot>)>;

  snapshot_cache(std::function<job_snapshot()> provider, std::vector<snapshot_view> views,
                 std::chrono::milliseconds max_age);
  ~snapshot_cache();  // stop()
  snapshot_cache(const snapshot_cache&) = delete;
  snapshot_cache& operator=(const snapshot_cache&) = delete;

  // Calls `ready` with a snapshot begun at or after `asked - max_age`: at once on this thread when
  // the cached one is, else on the refresher thread after the next build.
  void get(clock::time_point asked, ready_fn ready);

  // Joins the refresher (after the build in progress) and drops the readers still waiting.
  void stop();

  const std::vector<snapshot_view>& views() const { return views_; }
  std::uint64_t builds() const;  // provider calls so far

 private:
  struct waiter {
    clock::time_point asked;
    ready_fn ready;
  };
  void run();

  std::function<job_snapshot()> provider_;
  std::vector<snapshot_view> views_;
  std::chrono::milliseconds max_age_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  std::vector<waiter> waiting_;
  std::shared_ptr<const rendered_snapshot> latest_;
  std::uint64_t builds_ = 0;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace troupe::actors
