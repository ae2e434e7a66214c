// shutdown_watch: a step that takes long is named after the interval, then less often, with the
// time since the watch began; a quick shutdown says nothing, destroying the watch does not wait
// for an interval, and an interval <= 0 turns the watch off. The waits poll with generous
// deadlines, so a loaded machine makes them slower, not wrong.
#include <catch2/catch.hpp>

#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "actors/shutdown_watch.hpp"

using troupe::actors::detail::shutdown_watch;
using namespace std::chrono_literals;

namespace {

struct lines {
  std::mutex mu;
  std::vector<std::string> got;
  std::vector<std::string> copy() {
    std::lock_guard<std::mutex> lock(mu);
    return got;
  }
  auto sink() {
    return [this](const std::string& l) {
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(l);
    };
  }
  // Waits (up to 30 s) until at least n lines arrived; returns whether they did.
  bool wait_for(std::size_t n) {
    const auto deadline = std::chrono::steady_clock::now() + 30s;
    while (copy().size() < n) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(5ms);
    }
    return true;
  }
};

}  // namespace

TEST_CASE("A slow shutdown names the step it is in until it ends", "[actors]") {
  lines out;
  {
    shutdown_watch w("troupe: rank 3", "closing the UCX transport", 20ms, out.sink());
    REQUIRE(out.wait_for(1));
    w.stage("stopping the CAF actor system");
    REQUIRE(out.wait_for(2));
  }
  const auto got = out.copy();
  CHECK(got.front().rfind("troupe: rank 3: shutdown still closing the UCX transport after ", 0) ==
        0);
  CHECK(got.back().rfind("troupe: rank 3: shutdown still stopping the CAF actor system after ",
                         0) == 0);
  const auto after_end = got.size();
  std::this_thread::sleep_for(200ms);
  CHECK(out.copy().size() == after_end);  // nothing after the watch ended
}

TEST_CASE("A slow shutdown is reported after the interval and then six times less often",
          "[actors]") {
  lines out;
  const auto start = std::chrono::steady_clock::now();
  shutdown_watch w("troupe: rank 1", "leaving the job", 50ms, out.sink());
  REQUIRE(out.wait_for(2));
  // Lower bounds only: the second line cannot come before 50 ms + 6 x 50 ms.
  CHECK(std::chrono::steady_clock::now() - start >= 350ms);
}

TEST_CASE("A quick shutdown says nothing and its watch ends at once", "[actors]") {
  lines out;
  const auto start = std::chrono::steady_clock::now();
  {
    shutdown_watch w("troupe launch", "stopping the coordinator", std::chrono::hours(1),
                     out.sink());
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK(out.copy().empty());
}

TEST_CASE("A shutdown watch with an interval of zero or less is off", "[actors]") {
  lines out;
  for (const auto every : {0ms, -5ms}) {
    shutdown_watch w("troupe: rank 0", "leaving the job", every, out.sink());
    w.stage("closing the UCX transport");
    std::this_thread::sleep_for(50ms);
  }
  CHECK(out.copy().empty());
}
