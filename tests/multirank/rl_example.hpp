// Runs an RL example (apps/examples/grpo.cpp, ppo.cpp) under `troupe launch -n 1`, as a user runs
// it, and reads its per-iteration lines: "iteration N  mean reward R ... clipped C ... weights vV"
// (C: the policy's clip fraction, the first "clipped" of the line), and the line's printed
// numbers up to its timings.
#pragma once

#include <catch2/catch.hpp>

#include <unistd.h>

#include <chrono>
#include <regex>
#include <string>
#include <vector>

#include "tests/multirank/process.hpp"

namespace troupe::tests {

struct rl_iteration_line {
  int iteration = 0;
  double reward = 0, clipped = 0;
  int version = -1;
};

struct rl_example_run {
  std::string output;
  std::vector<rl_iteration_line> lines;
  std::vector<std::string> numbers;  // each iteration line from "mean reward" to its timings
};

// ranks: the processes `troupe launch -n` starts.
inline rl_example_run run_rl_example(const std::string& binary, const std::string& job,
                                     const std::vector<std::string>& flags, int ranks = 1) {
  using namespace std::chrono_literals;
  std::vector<std::string> argv{TROUPE_BIN, "launch",
                                "-n",       std::to_string(ranks),
                                "--job",    job + "-" + std::to_string(::getpid()),
                                "--",       binary};
  argv.insert(argv.end(), flags.begin(), flags.end());
  child_process p(argv, {{"TROUPE_NUM_THREADS", "1"}});
  auto st = p.wait(300s);
  rl_example_run r{p.output(), {}, {}};
  INFO(r.output);
  REQUIRE(st.has_value());
  REQUIRE(child_process::code(*st) == 0);
  const std::regex re(
      R"(iteration +(\d+) +mean reward ([0-9.]+) .*?clipped ([0-9.]+) .*weights v(\d+))");
  for (const auto& line : p.lines_with("mean reward")) {
    std::smatch m;
    REQUIRE(std::regex_search(line, m, re));
    r.lines.push_back({std::stoi(m[1]), std::stod(m[2]), std::stod(m[3]), std::stoi(m[4])});
    const auto from = line.find("mean reward");
    r.numbers.push_back(line.substr(from, line.find("  generate") - from));
  }
  return r;
}

// The mean reward of lines [from, from + n).
inline double mean_reward(const std::vector<rl_iteration_line>& v, std::size_t from,
                          std::size_t n) {
  double s = 0;
  for (std::size_t i = from; i < from + n; ++i) s += v[i].reward;
  return s / static_cast<double>(n);
}

}  // namespace troupe::tests
