// shutdown_watch: says where a slow shutdown is. Teardown code names each stage it enters
// (stage("closing the UCX transport")); while the watch lives, a thread prints
// "<who>: shutdown still <stage> after <s> s" to stderr once `every` has passed, then every
// 6 x `every` (10 s, then every 60 s), so a shutdown that hangs (a CAF actor system waiting for an
// actor that never ends, a join that never returns) names the step it hangs in, in the launcher's
// output, in a few lines. Destroying the watch stops its thread at once.
// Best effort: `every` <= 0 turns the watch off (no thread), and when the thread cannot be
// created (EAGAIN) the watch carries on without one; it never keeps a shutdown from running.
// Time comes from a watch_clock: the steady clock unless a test passes one it moves by hand.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

namespace troupe::actors::detail {

// What a shutdown_watch reads the time with and sleeps on. The steady clock in the product; tests
// pass a clock they advance by hand, so the intervals are checked without waiting for them.
class watch_clock {
 public:
  using time_point = std::chrono::steady_clock::time_point;
  virtual ~watch_clock() = default;
  virtual time_point now() = 0;
  // Waits on `cv` (under `lock`) until `done()` holds or the time reaches `until`; returns done().
  virtual bool wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                          time_point until, const std::function<bool()>& done) = 0;

  // The steady clock.
  static watch_clock& steady() {
    struct steady_clock final : watch_clock {
      time_point now() override { return std::chrono::steady_clock::now(); }
      bool wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv,
                      time_point until, const std::function<bool()>& done) override {
        return cv.wait_until(lock, until, done);
      }
    };
    static steady_clock c;
    return c;
  }
};

class shutdown_watch {
 public:
  // stage: the first step (set before the thread starts). say: where the lines go (default:
  // stderr). clock: what it tells the time with (it must outlive the watch).
  shutdown_watch(std::string who, std::string stage, std::chrono::milliseconds every,
                 std::function<void(const std::string&)> say = {},
                 watch_clock& clock = watch_clock::steady())
      : who_(std::move(who)),
        every_(every),
        say_(std::move(say)),
        clock_(clock),
        stage_(std::move(stage)) {
    if (every_.count() <= 0) return;
    try {
      thread_ = std::thread([this] { run(); });
    } catch (const std::system_error& e) {
      std::fprintf(stderr, "%s: shutdown goes on without its watch (no thread: %s)\n", who_.c_str(),
                   e.what());
    }
  }
  ~shutdown_watch() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  shutdown_watch(const shutdown_watch&) = delete;
  shutdown_watch& operator=(const shutdown_watch&) = delete;

  void stage(std::string what) {
    std::lock_guard<std::mutex> lock(mu_);
    stage_ = std::move(what);
  }
  // Whether a thread watches (false when off or without a thread).
  bool watching() const { return thread_.joinable(); }

 private:
  void run() {
    const auto start = clock_.now();
    auto next = start + every_;
    std::unique_lock<std::mutex> lock(mu_);
    while (!clock_.wait_until(lock, cv_, next, [&] { return done_; })) {
      const auto now = clock_.now();
      char secs[32];
      std::snprintf(secs, sizeof secs, "%.0f", std::chrono::duration<double>(now - start).count());
      const std::string line = who_ + ": shutdown still " + stage_ + " after " + secs + " s";
      if (say_) {
        say_(line);
      } else {
        std::fprintf(stderr, "%s\n", line.c_str());
        std::fflush(stderr);
      }
      next = now + 6 * every_;
    }
  }

  std::string who_;
  std::chrono::milliseconds every_;
  std::function<void(const std::string&)> say_;
  watch_clock& clock_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string stage_;
  bool done_ = false;
  std::thread thread_;  // started in the constructor body, after the members above exist
};

}  // namespace troupe::actors::detail
