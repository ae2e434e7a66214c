// Helpers for the suites that run `troupe train` across processes (hybrid_train.test.cpp,
// llama_recompute.test.cpp): a scratch folder, the single-process run and a launched run of the
// same tiny job (per-step losses from --json), and the check that two runs' losses agree.
#pragma once

#include <catch2/catch.hpp>

#include <unistd.h>

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

// The per-step losses of a --json file.
inline std::vector<double> losses(const std::string& path) {
  std::ifstream f(path);
  std::vector<double> out;
  std::string line;
  while (std::getline(f, line)) {
    auto k = line.find("\"loss\": ");
    if (k != std::string::npos) out.push_back(std::stod(line.substr(k + 8)));
  }
  return out;
}

// The run's flags: a tiny model, short sequences, 8 samples per step, clipping active.
inline std::vector<std::string> run_flags(const std::string& model, int steps) {
  return {"train",     "--model", model,         "--steps",  std::to_string(steps),
          "--batch",   "8",       "--seq",       "32",       "--warmup",
          "2",         "--clip",  "0.5",         "--sample", "0",
          "--threads", "1",       "--log-every", "100"};
}

inline std::vector<double> single(const std::string& model, int steps, const std::string& dir,
                                  std::vector<std::string> extra = {}) {
  auto argv = run_flags(model, steps);
  argv.insert(argv.begin(), troupe_bin);
  argv.insert(argv.end(), extra.begin(), extra.end());
  argv.push_back("--json");
  argv.push_back(dir + "/single.json");
  child_process p(argv);
  auto st = p.wait(std::chrono::seconds(300));
  INFO(p.output());
  REQUIRE(st.has_value());
  REQUIRE(child_process::code(*st) == 0);
  return losses(dir + "/single.json");
}

inline std::vector<double> launched(int n, const std::string& model, int steps,
                                    const std::string& dir, const std::string& name,
                                    std::vector<std::string> plan) {
  std::vector<std::string> argv = {troupe_bin, "launch",
                                   "-n",       std::to_string(n),
                                   "--job",    "hybrid-" + name + "-" + std::to_string(::getpid()),
                                   "--",       troupe_bin};
  auto flags = run_flags(model, steps);
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.insert(argv.end(), plan.begin(), plan.end());
  argv.push_back("--json");
  argv.push_back(dir + "/" + name + ".json");
  child_process p(argv);
  auto st = p.wait(std::chrono::seconds(300));
  INFO(p.output());
  REQUIRE(st.has_value());
  REQUIRE(child_process::code(*st) == 0);
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
