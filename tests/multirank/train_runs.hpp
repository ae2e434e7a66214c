// Runs of `troupe train` for the multi-process training suites (hybrid_train.test.cpp,
// resume_train.test.cpp): the single-process trainer and `troupe launch -n N -- troupe train` on a
// tiny model with the same flags, their per-step losses read back from --json. The single process
// runs twice, in f32 and as its f64 twin (--precision f64: the same weights, data and schedule in
// exact arithmetic, for f32's purposes); a launched run's losses must be as accurate as the f32
// single process's against the twin (tests/rounding.hpp, same_losses below).
#pragma once

#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <vector>

#include "tests/multirank/process.hpp"
#include "tests/multirank/same_weights.hpp"
#include "tests/rounding.hpp"

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

// The single-process `troupe train` (its --json in dir/<name>.json): the per-step losses.
inline std::vector<double> single(const std::string& model, int steps, const std::string& dir,
                                  std::vector<std::string> extra = {},
                                  const std::string& name = "single") {
  using namespace std::chrono_literals;
  auto argv = flags_with(model, steps, extra);
  argv.insert(argv.begin(), troupe_bin);
  argv.push_back("--json");
  argv.push_back(dir + "/" + name + ".json");
  child_process p(argv);
  auto st = p.wait(300s);
  INFO(p.output());
  REQUIRE(st.has_value());
  REQUIRE(child_process::code(*st) == 0);
  return losses(dir + "/" + name + ".json");
}

// The flags of a run's f64 twin: `extra` with --precision f64, its checkpoint in
// exact_twin(--checkpoint-dir).
inline std::vector<std::string> twin_flags(std::vector<std::string> extra) {
  auto ck = std::find(extra.begin(), extra.end(), "--checkpoint-dir");
  if (ck != extra.end() && ck + 1 != extra.end()) *(ck + 1) = exact_twin(*(ck + 1));
  extra.insert(extra.end(), {"--precision", "f64"});
  return extra;
}

// The per-step losses of the single process in f32 and of its f64 twin.
struct reference_losses {
  std::vector<double> f32, f64;
  // Steps first + 1 to last (1-based), of both.
  reference_losses steps(std::size_t first, std::size_t last) const {
    REQUIRE(last <= f32.size());
    REQUIRE(last <= f64.size());
    return {{f32.begin() + first, f32.begin() + last}, {f64.begin() + first, f64.begin() + last}};
  }
};

// single() and its f64 twin (twin_flags; its --json in dir/<name>-f64.json).
inline reference_losses single_and_twin(const std::string& model, int steps, const std::string& dir,
                                        const std::vector<std::string>& extra = {},
                                        const std::string& name = "single") {
  reference_losses r;
  r.f32 = single(model, steps, dir, extra, name);
  r.f64 = single(model, steps, dir, twin_flags(extra), name + "-f64");
  REQUIRE(r.f64.size() == r.f32.size());
  return r;
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

// The losses of a run equal the single process's as far as f32 rounding goes: over the steps
// together, max |got - f64| within trajectory_k times max |f32 - f64| (tests/rounding.hpp: a few
// scalars along a trajectory, whose largest errors are heavy-tailed), the f64 twin's own error
// being ~1e-16. Here rounding.hpp's floor (4 ulps of the first loss) sets the bound, ~1e-4
// absolute; measured errors stay under 3e-7 (ratios to the single process's 0.3 to 4, AVX-512 and
// AVX2 kernels). A wrong computation (a micro-batch left out, an update missed) moves the losses by
// 1e-3 relative and more from its step on.
inline void same_losses(const std::vector<double>& got, const reference_losses& want) {
  REQUIRE(got.size() == want.f32.size());
  REQUIRE(!want.f32.empty());
  const auto v = as_accurate_as(got, want.f32, want.f64, trajectory_k);
  if (print_ratios()) std::printf("ratios: losses: %s\n", v.str().c_str());
  INFO("losses of " << got.size() << " steps: " << v.str() << "; step " << v.where + 1 << ": "
                    << got[v.where] << ", single process " << want.f32[v.where] << ", f64 "
                    << want.f64[v.where]);
  CHECK(v.ok());
}

}  // namespace troupe::tests
