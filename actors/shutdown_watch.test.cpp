// shutdown_watch: a step that takes long is named every interval with the time since the watch
// began; a quick shutdown says nothing, and destroying the watch does not wait for an interval.
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
};

}  // namespace

TEST_CASE("A slow shutdown names the step it is in until it ends", "[actors]") {
  lines out;
  auto say = [&](const std::string& l) {
    std::lock_guard<std::mutex> lock(out.mu);
    out.got.push_back(l);
  };
  {
    shutdown_watch w("troupe: rank 3", 40ms, say);
    w.stage("closing the UCX transport");
    std::this_thread::sleep_for(300ms);
  }
  const auto got = out.copy();
  REQUIRE(got.size() >= 2);
  CHECK(got.front().rfind("troupe: rank 3: shutdown still closing the UCX transport after ", 0) ==
        0);
  const auto n = got.size();
  std::this_thread::sleep_for(100ms);
  CHECK(out.copy().size() == n);  // nothing after the watch ended
}

TEST_CASE("A quick shutdown says nothing and its watch ends at once", "[actors]") {
  lines out;
  const auto start = std::chrono::steady_clock::now();
  {
    shutdown_watch w("troupe launch", std::chrono::hours(1), [&](const std::string& l) {
      std::lock_guard<std::mutex> lock(out.mu);
      out.got.push_back(l);
    });
    w.stage("stopping the coordinator");
  }
  CHECK(std::chrono::steady_clock::now() - start < 5s);
  CHECK(out.copy().empty());
}
