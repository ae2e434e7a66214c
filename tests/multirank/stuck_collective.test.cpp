// A stuck collective in a launched run: one rank of `troupe launch -n 2 -- troupe train --dp 2`
// is stopped (SIGSTOP) while heartbeats are told to wait an hour, so only the collective deadline
// (--collective-timeout) can notice. The other rank's op fails at its deadline with the flight
// recorder's view naming the stopped rank, `troupe train` ends with that error, and the launcher
// ends the job. The test waits for the launcher's exit, never for time.
#include <catch2/catch.hpp>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "tests/multirank/process.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;
using namespace std::chrono_literals;

TEST_CASE("A rank that stops taking part in a collective fails the job at the deadline naming it",
          "[multirank][faults]") {
  std::vector<std::string> a = {
      troupe_bin, "launch",  "-n", "2",     "--heartbeat-timeout",
      "3600",     "--grace", "1",  "--job", "stuck-collective-" + std::to_string(::getpid()),
      "--",       troupe_bin};
  auto flags = run_flags("gpt2-demo", 100000);
  auto every = std::find(flags.begin(), flags.end(), "--log-every");
  REQUIRE(every != flags.end());
  *(every + 1) = "1";
  a.insert(a.end(), flags.begin(), flags.end());
  for (const char* f : {"--dp", "2", "--collective-timeout", "3"}) a.push_back(f);
  child_process p(a);
  REQUIRE(p.wait_for("step     3/", 120s));
  // "troupe coordinator: rank 1 (host vm, pid 1234) joined (...)"
  auto joined = p.lines_with("rank 1 (host");
  REQUIRE(!joined.empty());
  auto at = joined.front().find("pid ");
  REQUIRE(at != std::string::npos);
  const pid_t victim = std::stoi(joined.front().substr(at + 4));
  REQUIRE(::kill(victim, SIGSTOP) == 0);
  // Rank 0 fails at its deadline; the launcher stops the job (SIGTERM, then SIGKILL for the
  // stopped rank) and exits.
  auto st = p.wait(180s);
  if (!st) ::kill(victim, SIGKILL);
  INFO(p.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) != 0);
  std::string named;
  for (const auto& l : p.lines_with("deadline of 3000 ms passed"))
    if (l.find("[rank 0]") != std::string::npos &&
        l.find("rank 0 is waiting for rank 1") != std::string::npos)
      named = l;
  INFO(named);
  REQUIRE(!named.empty());
  CHECK(named.find("troupe: error: ") != std::string::npos);  // troupe train ends with it
  CHECK(named.find(" on ucx:dp#") != std::string::npos);      // the op and its group
  CHECK(named.find("group ranks 0,1") != std::string::npos);
  CHECK(!p.lines_with("ranks failed").empty());  // the launcher's end of the job
  std::printf("faults: a stuck collective (launched, rank 1 stopped) -> refused: %s\n",
              named.c_str());
}
