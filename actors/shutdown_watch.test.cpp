// shutdown_watch: a step that takes long is named after the interval, then less often, with the
// time since the watch began; a quick shutdown says nothing, destroying the watch does not wait
// for an interval, and an interval <= 0 turns the watch off. The watch runs on a clock the test
// moves by hand: every wait is on an event (the watch asleep until a time, a line said), so a
// loaded machine makes the tests slower, never wrong.
#include <catch2/catch.hpp>

#include <chrono>
#include <condition_variable>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "actors/shutdown_watch.hpp"

using troupe::actors::detail::shutdown_watch;
using troupe::actors::detail::watch_clock;
using namespace std::chrono_literals;

namespace {

// Generous: only a broken watch makes a wait last this long.
constexpr auto hang_guard = 60s;

struct lines {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> got;
  std::vector<std::string> copy() {
    std::lock_guard<std::mutex> lock(mu);
    return got;
  }
  auto sink() {
    return [this](const std::string& l) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(l);
      cv.notify_all();
    };
  }
  // Whether at least n lines arrived (false only after the hang guard).
  bool wait_for(std::size_t n) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, hang_guard, [&] { return got.size() >= n; });
  }
};

// A clock that moves only when the test advances it. It knows when the watch sleeps and until
// when, so a test can wait for the watch to have taken in each advance.
class manual_clock final : public watch_clock {
 public:
  time_point now() override {
    std::lock_guard<std::mutex> lock(mu_);
    return now_;
  }
  bool wait_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, time_point until,
                  const std::function<bool()>& done) override {
    while (!done()) {
      {
        std::lock_guard<std::mutex> g(mu_);
        if (now_ >= until) break;
        sleeper_ = sleeper{lock.mutex(), &cv, until, advances_};
      }
      changed_.notify_all();
      cv.wait(
          lock);  // the caller's lock: advance() takes it before notifying, so no wakeup is lost
    }
    {
      std::lock_guard<std::mutex> g(mu_);
      sleeper_.reset();
    }
    return done();
  }

  void advance(std::chrono::milliseconds d) {
    std::optional<sleeper> s;
    {
      std::lock_guard<std::mutex> lock(mu_);
      now_ += d;
      ++advances_;
      s = sleeper_;
    }
    if (s) {
      std::lock_guard<std::mutex> lock(*s->mu);
      s->cv->notify_all();
    }
  }
  // The time the watch sleeps until once it took in every advance so far (nullopt after the hang
  // guard), as an offset from where the clock started.
  std::optional<std::chrono::milliseconds> sleeping_until() {
    std::unique_lock<std::mutex> lock(mu_);
    if (!changed_.wait_for(lock, hang_guard,
                           [&] { return sleeper_ && sleeper_->advances == advances_; }))
      return std::nullopt;
    return std::chrono::duration_cast<std::chrono::milliseconds>(sleeper_->until - time_point{});
  }

 private:
  struct sleeper {
    std::mutex* mu;
    std::condition_variable* cv;
    time_point until;
    int advances;  // how many advances it had seen when it went to sleep
  };
  std::mutex mu_;
  std::condition_variable changed_;
  time_point now_{};
  int advances_ = 0;
  std::optional<sleeper> sleeper_;
};

}  // namespace

TEST_CASE("A slow shutdown names the step it is in until it ends", "[actors]") {
  manual_clock clock;
  lines out;
  {
    shutdown_watch w("troupe: rank 3", "closing the UCX transport", 10s, out.sink(), clock);
    REQUIRE(clock.sleeping_until() == 10s);
    clock.advance(10s);
    REQUIRE(out.wait_for(1));
    w.stage("stopping the CAF actor system");
    REQUIRE(clock.sleeping_until() == 70s);
    clock.advance(60s);
    REQUIRE(out.wait_for(2));
  }
  CHECK(out.copy() ==
        std::vector<std::string>{
            "troupe: rank 3: shutdown still closing the UCX transport after 10 s",
            "troupe: rank 3: shutdown still stopping the CAF actor system after 70 s"});
  clock.advance(std::chrono::hours(1));
  CHECK(out.copy().size() == 2);  // nothing after the watch ended (its thread is joined)
}

TEST_CASE("A slow shutdown is reported after the interval and then six times less often",
          "[actors]") {
  manual_clock clock;
  lines out;
  shutdown_watch w("troupe: rank 1", "leaving the job", 10s, out.sink(), clock);
  REQUIRE(clock.sleeping_until() == 10s);
  clock.advance(9s);
  REQUIRE(clock.sleeping_until() == 10s);  // woken early: still waits for the interval
  CHECK(out.copy().empty());
  clock.advance(1s);
  REQUIRE(out.wait_for(1));
  REQUIRE(clock.sleeping_until() == 70s);  // then six intervals
  clock.advance(59s);
  REQUIRE(clock.sleeping_until() == 70s);
  CHECK(out.copy().size() == 1);
  clock.advance(1s);
  REQUIRE(out.wait_for(2));
  REQUIRE(clock.sleeping_until() == 130s);
  CHECK(out.copy().back() == "troupe: rank 1: shutdown still leaving the job after 70 s");
}

TEST_CASE("A quick shutdown says nothing and its watch ends at once", "[actors]") {
  manual_clock clock;
  lines out;
  auto w = std::make_unique<shutdown_watch>("troupe launch", "stopping the coordinator", 1h,
                                            out.sink(), clock);
  REQUIRE(clock.sleeping_until() == 1h);
  // The clock never moves: the watch ends only because it is destroyed, not by any interval.
  auto ended = std::async(std::launch::async, [&] { w.reset(); });
  REQUIRE(ended.wait_for(hang_guard) == std::future_status::ready);
  CHECK(out.copy().empty());
}

TEST_CASE("A shutdown watch with an interval of zero or less is off", "[actors]") {
  manual_clock clock;
  lines out;
  for (const auto every : {0ms, -5ms}) {
    shutdown_watch w("troupe: rank 0", "leaving the job", every, out.sink(), clock);
    CHECK_FALSE(w.watching());
    w.stage("closing the UCX transport");
    clock.advance(1h);
  }
  CHECK(out.copy().empty());
}
