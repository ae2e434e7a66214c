// The main job's three ways in, run as a user runs them (issue 6, requirement 5), each compared
// with the single-process `troupe train` at the same tokens per step, seed and data, as far as f32
// rounding goes: the single process runs again as its f64 twin (--precision f64) and the way in
// must be as accurate as it (tests/rounding.hpp; same_losses, same_weights):
//   - the C++ actor script apps/examples/pretrain.cpp under `troupe launch -n 4`: its logged
//     losses under both its plans and its checkpoints' weights, a checkpoint that the single
//     process resumes (its next steps' losses equal the straight run's, and a resume at another
//     --seq is refused naming the flag), text sampled from it;
//   - examples/hybrid.toml under `troupe launch -n <its ranks>`: the losses of the same job file
//     without its [parallel] table in one process, and its checkpoint's weights;
//   - the launched command of scripts/demo.sh (read from the script): progress, loss and tokens/s
//     lines, a checkpoint, generated text, and the single process's losses and weights.
// Runs are a few steps long; every rank runs one thread (4 ranks share the machine's cores).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "models/train_config.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;
namespace fs = std::filesystem;

namespace {

const std::string source_dir = TROUPE_SOURCE_DIR;

struct finished {
  int code = -1;
  std::string output;
};

// Runs argv to its end with one thread per process.
finished run(const std::vector<std::string>& argv) {
  using namespace std::chrono_literals;
  child_process p(argv, {{"TROUPE_NUM_THREADS", "1"}});
  auto st = p.wait(120s);
  INFO(p.output());
  REQUIRE(st.has_value());
  return {child_process::code(*st), p.output()};
}

// A run that must succeed: its output.
std::string succeeds(const std::vector<std::string>& argv) {
  auto r = run(argv);
  INFO(r.output);
  REQUIRE(r.code == 0);
  return r.output;
}

std::vector<std::string> launcher(int n, const std::string& job) {
  return {troupe_bin, "launch",
          "-n",       std::to_string(n),
          "--job",    job + "-" + std::to_string(::getpid()),
          "--"};
}

std::vector<std::string> operator+(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

// The trainer_state.json step of a checkpoint folder.
std::int64_t saved_step(const std::string& folder) {
  std::ifstream f(folder + "/trainer_state.json");
  REQUIRE(f.good());
  std::stringstream text;
  text << f.rdbuf();
  std::smatch m;
  const std::string s = text.str();
  REQUIRE(std::regex_search(s, m, std::regex(R"("step": (\d+))")));
  return std::stoll(m[1]);
}

// The output prints text sampled from the checkpoint: the prompt ("The ") and more after it.
void prints_a_sample(const std::string& out) {
  const std::string head = "sample from the checkpoint (temperature 0.8, top-k 40):\n[rank 0] The ";
  auto at = out.find(head);
  REQUIRE(at != std::string::npos);
  // Only rank 0's consecutive lines after the header (other ranks and the launcher print too).
  std::string sample;
  std::size_t pos = at + head.size() - std::string("[rank 0] The ").size();
  while (pos < out.size() && out.compare(pos, 9, "[rank 0] ") == 0) {
    const auto end = out.find('\n', pos);
    sample += out.substr(pos + 9, end == std::string::npos ? std::string::npos : end - pos - 9);
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  INFO(sample);
  CHECK(sample.size() >= 100);  // 200 bytes generated, a few cut at newlines
}

// The example's log ("step   1  loss 5.5560  ...", four decimals) gives `want`'s losses: each
// within the printing's half unit (5e-5) of the f64 twin's, plus what f32 rounding allows
// (same_losses' bound: trajectory_k times the single process's error against its twin). The
// printing dominates; its checkpoint's weights are held to rounding alone (same_weights).
void logs_losses(const std::string& out, const reference_losses& want) {
  INFO(out);
  std::vector<double> got;
  const std::regex line(R"(step +(\d+) +loss ([0-9.]+))");
  for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it)
    got.push_back(std::stod((*it)[2]));
  REQUIRE(got.size() == want.f32.size());
  const double rounding = as_accurate_as(want.f32, want.f32, want.f64, trajectory_k).bound;
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO("step " << i + 1 << ": " << got[i] << " vs " << want.f32[i] << " (f64 " << want.f64[i]
                 << "), allowed " << 5e-5 + rounding);
    CHECK(std::abs(got[i] - want.f64[i]) <= 5e-5 + rounding);
  }
}

}  // namespace

TEST_CASE("The pretrain example trains like troupe train and leaves a checkpoint it resumes from",
          "[multirank][slow]") {
  scratch_dir dir("example-pretrain");
  const std::string ckpt = dir.path + "/example";
  // The example's run (apps/examples/pretrain.cpp) in one process: 5 steps, all in the warmup,
  // so the learning rates do not depend on --steps and 3 steps + 2 resumed ones equal 5 straight.
  const std::vector<std::string> same = {"train", "--batch",  "8", "--seq",     "64", "--warmup",
                                         "10",    "--sample", "0", "--threads", "1",  "--log-every",
                                         "100"};
  const std::vector<std::string> single = std::vector<std::string>{troupe_bin} + same;
  const std::vector<std::string> f64 = {"--precision", "f64"};
  succeeds(single +
           std::vector<std::string>{"--steps", "5", "--json", dir.path + "/straight.json"});
  succeeds(single + f64 +
           std::vector<std::string>{"--steps", "5", "--json", dir.path + "/straight-f64.json"});
  const reference_losses want = {losses(dir.path + "/straight.json"),
                                 losses(dir.path + "/straight-f64.json")};
  REQUIRE(want.f32.size() == 5);
  REQUIRE(want.f64.size() == 5);
  // The weights after 3 steps, which the example's checkpoints must hold.
  const std::string three = dir.path + "/three";
  succeeds(single + std::vector<std::string>{"--steps", "3", "--checkpoint-dir", three});
  succeeds(single + f64 +
           std::vector<std::string>{"--steps", "3", "--checkpoint-dir", exact_twin(three)});

  const auto out = succeeds(launcher(4, "example-pretrain") +
                            std::vector<std::string>{TROUPE_EXAMPLE_PRETRAIN_BIN, "--steps", "3",
                                                     "--log-every", "1", "--checkpoint-dir", ckpt});
  INFO(out);
  logs_losses(out, want.steps(0, 3));
  CHECK(saved_step(ckpt) == 3);
  same_weights(ckpt, three);
  prints_a_sample(out);
  // Its other plan, dp 2 x tp 2 with sequence parallelism.
  logs_losses(succeeds(launcher(4, "example-pretrain-tp") +
                       std::vector<std::string>{TROUPE_EXAMPLE_PRETRAIN_BIN, "--tp", "--steps", "3",
                                                "--log-every", "1", "--sample", "0",
                                                "--checkpoint-dir", dir.path + "/example-tp"}),
              want.steps(0, 3));
  same_weights(dir.path + "/example-tp", three);

  // troupe train --resume takes its checkpoint: steps 4 and 5 as the straight run's.
  succeeds(single + std::vector<std::string>{"--steps", "5", "--resume", ckpt, "--json",
                                             dir.path + "/resumed.json"});
  same_losses(losses(dir.path + "/resumed.json"), want.steps(3, 5));
  // ... but not with another sequence length: its steps would read other batches.
  auto other = single + std::vector<std::string>{"--steps", "5", "--resume", ckpt};
  other[std::find(other.begin(), other.end(), "--seq") - other.begin() + 1] = "32";
  auto refused = run(other);
  CHECK(refused.code != 0);
  CHECK_THAT(refused.output, Catch::Contains("train.seq (--seq) = 64") &&
                                 Catch::Contains("this run has 32") &&
                                 Catch::Contains(ckpt + "/trainer_state.json"));
}

TEST_CASE("The TOML example trains like one process running it without its parallel table",
          "[multirank][slow]") {
  scratch_dir dir("example-toml");
  const std::string job = source_dir + "/examples/hybrid.toml", one = dir.path + "/single.toml";
  {  // the job file without [parallel] (up to the next table or the end)
    std::ifstream in(job);
    REQUIRE(in.good());
    std::ofstream out(one);
    std::string l;
    bool in_parallel = false, seen = false;
    while (std::getline(in, l)) {
      if (!l.empty() && l.front() == '[') in_parallel = l.rfind("[parallel]", 0) == 0;
      seen = seen || in_parallel;
      if (!in_parallel) out << l << "\n";
    }
    REQUIRE(seen);
  }
  const auto hybrid = models::load_train_config(job).value();
  auto plain = models::load_train_config(one).value();
  REQUIRE(hybrid.plan.world_size() > 1);
  CHECK(plain.plan.world_size() == 1);
  plain.plan = hybrid.plan;
  CHECK(plain == hybrid);  // only the plan was left out

  const std::vector<std::string> short_run = {"--steps", "3", "--sample", "0", "--threads", "1"};
  const auto out =
      succeeds(launcher(static_cast<int>(hybrid.plan.world_size()), "example-toml") +
               std::vector<std::string>{troupe_bin, "train", "--config", job, "--checkpoint-dir",
                                        dir.path + "/hybrid", "--json", dir.path + "/hybrid.json"} +
               short_run);
  INFO(out);
  CHECK_THAT(out, Catch::Contains(scheduler::describe(hybrid.plan)));
  CHECK(saved_step(dir.path + "/hybrid") == 3);
  const std::string single = dir.path + "/single";
  succeeds(std::vector<std::string>{troupe_bin, "train", "--config", one, "--checkpoint-dir",
                                    single, "--json", single + ".json"} +
           short_run);
  succeeds(std::vector<std::string>{troupe_bin, "train", "--config", one, "--precision", "f64",
                                    "--checkpoint-dir", exact_twin(single), "--json",
                                    exact_twin(single) + ".json"} +
           short_run);
  same_losses(losses(dir.path + "/hybrid.json"),
              {losses(single + ".json"), losses(exact_twin(single) + ".json")});
  same_weights(dir.path + "/hybrid", single);
}

TEST_CASE("The demo's launched command trains and checkpoints and samples", "[multirank][slow]") {
  scratch_dir dir("example-demo");
  // The `troupe launch` command of scripts/demo.sh, its continuation lines joined.
  std::ifstream script(source_dir + "/scripts/demo.sh");
  REQUIRE(script.good());
  std::string l, command;
  bool in_command = false;
  while (std::getline(script, l)) {
    in_command = in_command || l.find("troupe launch") != std::string::npos;
    if (!in_command) continue;
    const bool more = !l.empty() && l.back() == '\\';
    command += (more ? l.substr(0, l.size() - 1) : l) + " ";
    if (!more) break;
  }
  INFO("scripts/demo.sh: " << command);
  std::vector<std::string> argv;
  std::istringstream words(command);
  for (std::string w; words >> w;) {
    if (w == "./build/apps/troupe") {
      argv.push_back(troupe_bin);
    } else if (w == "\"$@\"") {  // the user's arguments: a short run, its losses to a file
      argv.insert(argv.end(), {"--steps", "5", "--json", dir.path + "/demo.json"});
    } else {
      argv.push_back(w);
    }
  }
  auto ckpt = std::find(argv.begin(), argv.end(), "--checkpoint-dir");
  REQUIRE(ckpt != argv.end());
  REQUIRE(ckpt + 1 != argv.end());
  *(ckpt + 1) = dir.path + "/demo";  // not the demo's /tmp/troupe-demo
  REQUIRE(argv.size() > 2);
  REQUIRE(argv[1] == "launch");
  REQUIRE(std::find(argv.begin(), argv.end(), "--json") != argv.end());

  const auto out = succeeds(argv);
  INFO(out);
  for (const char* step : {"step     1/5  loss ", "step     5/5  loss "}) {
    std::regex progress(std::string(step) + R"([0-9.]+ .* [0-9]+ tokens/s)");
    CHECK(std::regex_search(out, progress));
  }
  CHECK_THAT(out, Catch::Contains("trained to step 5") &&
                      Catch::Contains("checkpoint: " + dir.path + "/demo"));
  CHECK(saved_step(dir.path + "/demo") == 5);
  prints_a_sample(out);
  // The same run in one process: the demo's model and data are troupe train's defaults.
  const std::string single = dir.path + "/single";
  const std::vector<std::string> plain = {troupe_bin,
                                          "train",
                                          "--demo",
                                          "--steps",
                                          "5",
                                          "--sample",
                                          "0",
                                          "--threads",
                                          "1",
                                          "--json",
                                          single + ".json",
                                          "--checkpoint-dir",
                                          single};
  succeeds(plain);
  succeeds({troupe_bin, "train", "--demo", "--steps", "5", "--sample", "0", "--threads", "1",
            "--precision", "f64", "--json", exact_twin(single) + ".json", "--checkpoint-dir",
            exact_twin(single)});
  const reference_losses want = {losses(single + ".json"), losses(exact_twin(single) + ".json")};
  same_losses(losses(dir.path + "/demo.json"), want);
  same_weights(dir.path + "/demo", single);
  CHECK(want.f32.back() < want.f32.front());  // it learns: not rounding, a drop of about 1
}
