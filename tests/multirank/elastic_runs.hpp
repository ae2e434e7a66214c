// Launched elastic runs for the multi-process elastic suites (elastic.test.cpp,
// elastic_zero.test.cpp): the launch line, running one to its end, and the bitwise comparison of a
// run with a loss against its fault-free run (the --json numbers without timings, the checkpoint's
// weights and AdamW moments).
#pragma once

#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <regex>
#include <string>
#include <vector>

#include "tests/multirank/process.hpp"
#include "tests/multirank/train_runs.hpp"

namespace troupe::tests {

using namespace std::chrono_literals;

inline std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A --json file's lines without the timing field: step, loss, grad norm, lr.
inline std::vector<std::string> numbers_of(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  std::string line;
  while (std::getline(f, line)) out.push_back(line.substr(0, line.find(", \"tokens_per_s\"")));
  return out;
}

// `troupe launch -n n --spares s -- troupe train <plan> --elastic --json dir/name.json
// --checkpoint-dir dir/name`.
inline std::vector<std::string> elastic_argv(int n, int spares, const std::string& dir,
                                             const std::string& name, std::vector<std::string> plan,
                                             int steps = 6) {
  plan.insert(plan.end(),
              {"--elastic", "--checkpoint-dir", dir + "/" + name, "--collective-timeout", "60"});
  auto argv = launch_argv(n, "gpt2-demo", steps, dir, "e-" + name, plan);
  argv.insert(argv.begin() + 4, {"--spares", std::to_string(spares)});
  // launch_argv names the json after its run name.
  for (auto& a : argv)
    if (a == dir + "/e-" + name + ".json") a = dir + "/" + name + ".json";
  return argv;
}

// Runs it to its end: the output, after checking the exit code.
inline std::string run(const std::vector<std::string>& argv, int want_code) {
  child_process p(argv);
  auto st = p.wait(300s);
  INFO(p.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) == want_code);
  return p.output();
}

// The run `name` printed the numbers of `clean` and wrote its checkpoint byte for byte.
inline void same_bits(const std::string& dir, const std::string& name, const std::string& clean) {
  const auto got = numbers_of(dir + "/" + name + ".json"),
             want = numbers_of(dir + "/" + clean + ".json");
  REQUIRE(!want.empty());
  CHECK(got == want);
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    const auto a = file_bytes(dir + "/" + name + "/" + f),
               b = file_bytes(dir + "/" + clean + "/" + f);
    INFO(f);
    REQUIRE(!b.empty());
    CHECK(a == b);
  }
}

inline std::string first_line_with(const std::string& output, const std::string& needle) {
  const auto at = output.find(needle);
  if (at == std::string::npos) return {};
  const auto end = output.find('\n', at);
  return output.substr(at, end == std::string::npos ? std::string::npos : end - at);
}

// The faults line of a survived loss: the recovery's own log line.
inline void survived(const std::string& what, const std::string& output) {
  const auto line = first_line_with(output, "elastic: rank ");
  REQUIRE(!line.empty());
  std::printf("faults: %s -> survived: %s\n", what.c_str(), line.c_str());
}

// The pid of rank `rank` from the coordinator's line "rank R (host H, pid P) joined" in p's
// output so far (-1 before it).
inline int pid_of_rank(child_process& p, int rank) {
  const std::regex re("rank " + std::to_string(rank) + " \\(host [^,]+, pid ([0-9]+)\\) joined");
  int pid = -1;
  for (const auto& l : p.lines_with("rank " + std::to_string(rank) + " (host ")) {
    std::smatch m;
    if (std::regex_search(l, m, re)) pid = std::stoi(m[1]);
  }
  return pid;
}

}  // namespace troupe::tests
