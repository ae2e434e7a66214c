// Runs of `troupe train` for the multi-process training suites (hybrid_train.test.cpp,
// resume_train.test.cpp): the single-process trainer and `troupe launch -n N -- troupe train` on a
// tiny model with the same flags, their per-step losses read back from --json, compared within
// 1e-4 relative.
#pragma once

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "tests/multirank/process.hpp"

namespace troupe::tests {

inline const std::string troupe_bin = TROUPE_BIN;

// A fresh folder under the temp directory for the test `what` of this process.
inline std::string scratch(const std::string& what) {
  auto p = std::filesystem::temp_directory_path() /
           ("troupe-hybrid-" + what + "-" + std::to_string(::getpid()));
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

// A scratch folder removed when the guard goes, a failed REQUIRE included.
struct scratch_dir {
  explicit scratch_dir(const std::string& what) : path(scratch(what)) {}
  ~scratch_dir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  scratch_dir(const scratch_dir&) = delete;
  scratch_dir& operator=(const scratch_dir&) = delete;
  std::string path;
};

// The per-step values of `key` ("loss", "lr") of a --json file.
inline std::vector<double> json_values(const std::string& path, const std::string& key) {
  std::ifstream f(path);
  std::vector<double> out;
  std::string line;
  const std::string needle = "\"" + key + "\": ";
  while (std::getline(f, line)) {
    auto k = line.find(needle);
    if (k != std::string::npos) out.push_back(std::stod(line.substr(k + needle.size())));
  }
  return out;
}

// The per-step losses of a --json file.
inline std::vector<double> losses(const std::string& path) {
  return json_values(path, "loss");
}

// The run's flags: a tiny model, short sequences, 8 samples per step, clipping active.
inline std::vector<std::string> run_flags(const std::string& model, int steps) {
  return {"train",     "--model", model,         "--steps",  std::to_string(steps),
          "--batch",   "8",       "--seq",       "32",       "--warmup",
          "2",         "--clip",  "0.5",         "--sample", "0",
          "--threads", "1",       "--log-every", "100"};
}

// run_flags then `extra`; a flag of run_flags that `extra` gives too ("--warmup", "4") is left out
// of run_flags (troupe train takes each flag once).
inline std::vector<std::string> flags_with(const std::string& model, int steps,
                                           const std::vector<std::string>& extra) {
  const auto defaults = run_flags(model, steps);
  std::vector<std::string> out = {defaults.front()};  // "train"; then flag-value pairs
  for (std::size_t i = 1; i + 1 < defaults.size(); i += 2)
    if (std::find(extra.begin(), extra.end(), defaults[i]) == extra.end())
      out.insert(out.end(), {defaults[i], defaults[i + 1]});
  out.insert(out.end(), extra.begin(), extra.end());
  return out;
}

// The single-process `troupe train` (its --json in dir/single.json): the per-step losses.
inline std::vector<double> single(const std::string& model, int steps, const std::string& dir,
                                  std::vector<std::string> extra = {}) {
  using namespace std::chrono_literals;
  auto argv = flags_with(model, steps, extra);
  argv.insert(argv.begin(), troupe_bin);
  argv.push_back("--json");
  argv.push_back(dir + "/single.json");
  child_process p(argv);
  auto st = p.wait(300s);
  INFO(p.output());
  REQUIRE(st.has_value());
  REQUIRE(child_process::code(*st) == 0);
  return losses(dir + "/single.json");
}

// `troupe launch -n n -- troupe train ... <plan>` with its --json in dir/<name>.json.
inline std::vector<std::string> launch_argv(int n, const std::string& model, int steps,
                                            const std::string& dir, const std::string& name,
                                            const std::vector<std::string>& plan) {
  std::vector<std::string> argv = {troupe_bin, "launch",
                                   "-n",       std::to_string(n),
                                   "--job",    "hybrid-" + name + "-" + std::to_string(::getpid()),
                                   "--",       troupe_bin};
  auto flags = flags_with(model, steps, plan);
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back("--json");
  argv.push_back(dir + "/" + name + ".json");
  return argv;
}

// launch_argv's run, which must succeed: the losses (and its output into *output when given).
inline std::vector<double> launched(int n, const std::string& model, int steps,
                                    const std::string& dir, const std::string& name,
                                    std::vector<std::string> plan, std::string* output = nullptr) {
  using namespace std::chrono_literals;
  child_process p(launch_argv(n, model, steps, dir, name, plan));
  auto st = p.wait(300s);
  INFO(p.output());
  REQUIRE(st.has_value());
  REQUIRE(child_process::code(*st) == 0);
  if (output != nullptr) *output = p.output();
  return losses(dir + "/" + name + ".json");
}

inline void same_losses(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  REQUIRE(!want.empty());
  for (std::size_t i = 0; i < want.size(); ++i) {
    INFO("step " << i + 1 << ": " << got[i] << " vs " << want[i]);
    CHECK(std::abs(got[i] - want[i]) <= 1e-4 * std::abs(want[i]));
  }
}

}  // namespace troupe::tests
