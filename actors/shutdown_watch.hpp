// shutdown_watch: says where a slow shutdown is. Teardown code names each stage it enters
// (stage("closing the UCX transport")); while the watch lives, a thread prints
// "<who>: shutdown still <stage> after <s> s" to stderr every `every`, so a shutdown that hangs
// (a CAF actor system waiting for an actor that never ends, a join that never returns) names the
// step it hangs in, in the launcher's output. Destroying the watch stops its thread at once.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

namespace troupe::actors::detail {

class shutdown_watch {
 public:
  // say: where the lines go (default: stderr).
  shutdown_watch(std::string who, std::chrono::milliseconds every,
                 std::function<void(const std::string&)> say = {})
      : who_(std::move(who)), every_(every), say_(std::move(say)), thread_([this] { run(); }) {}
  ~shutdown_watch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  shutdown_watch(const shutdown_watch&) = delete;
  shutdown_watch& operator=(const shutdown_watch&) = delete;

  void stage(std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    stage_ = std::move(what);
  }

 private:
  void run() {
    const auto start = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(mu_);
    while (!cv_.wait_for(lock, every_, [&] { return done_; })) {
      const double s =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.0f", s);
      const std::string line = who_ + ": shutdown still " + stage_ + " after " + secs + " s";
      if (say_) {
        say_(line);
      } else {
        std::fprintf(stderr, "%s\n", line.c_str());
        std::fflush(stderr);
      }
    }
  }

  std::string who_;
  std::chrono::milliseconds every_;
  std::function<void(const std::string&)> say_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string stage_ = "starting";
  bool done_ = false;
  std::thread thread_;  // last: starts after the members above exist
};

}  // namespace troupe::actors::detail
