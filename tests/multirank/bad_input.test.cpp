// Bad input and a full disk, through the `troupe` binary as a user meets them (the fault matrix of
// issue 20, ctest -L faults): unknown flags of `troupe train` and `troupe launch`, job files with a
// syntax error, an unknown key or a wrong type, a checkpoint folder holding the user's files
// (refused when the run starts, before any step, with nothing deleted), and a disk that fills
// during a checkpoint (a small tmpfs: the save fails naming the file, the previous checkpoint stays
// whole and resumable, the user's files beside it stay). Each prints its "faults:" line.
#include <catch2/catch.hpp>

#include <sys/mount.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;
using Catch::Contains;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

// 's' (built by appending: GCC 12 at -O3 warns -Wrestrict inside "'" + std::string).
std::string q(const std::string& s) {
  std::string out(1, '\'');
  out += s;
  out += '\'';
  return out;
}

struct run_result {
  int code = -1;
  std::string output;
};

// Runs the troupe binary with `args` to its end (a generous deadline guards against a hang).
run_result run_troupe(std::vector<std::string> args) {
  args.insert(args.begin(), troupe_bin);
  child_process p(args);
  auto st = p.wait(120s);
  INFO(p.output());
  REQUIRE(st.has_value());
  return {child_process::code(*st), p.output()};
}

// The first line of `out` containing `needle` ("" when none).
std::string line_with(const std::string& out, const std::string& needle) {
  const auto at = out.find(needle);
  if (at == std::string::npos) return "";
  const auto begin = out.rfind('\n', at) == std::string::npos ? 0 : out.rfind('\n', at) + 1;
  return out.substr(begin, out.find('\n', at) - begin);
}

void print_fault(const std::string& what, const std::string& line) {
  std::printf("faults: %s -> refused: %s\n", what.c_str(), line.c_str());
}

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The quick run: the demo model, a few steps, one thread, no sample.
std::vector<std::string> demo_run(int steps, std::vector<std::string> extra) {
  std::vector<std::string> a = {"train",     "--demo", "--steps",  std::to_string(steps),
                                "--threads", "1",      "--sample", "0"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// A tmpfs of `bytes` mounted on a fresh folder while alive; ok() is false where this process may
// not mount (not root, or no CAP_SYS_ADMIN in a container), with why().
class small_tmpfs {
 public:
  small_tmpfs(const fs::path& at, std::uint64_t bytes) : at_(at) {
    fs::create_directories(at_);
    const std::string opts = "size=" + std::to_string(bytes) + ",mode=0700";
    if (::mount("tmpfs", at_.c_str(), "tmpfs", MS_NOSUID | MS_NODEV, opts.c_str()) == 0)
      mounted_ = true;
    else
      why_ = std::string("mount -t tmpfs: ") + std::strerror(errno);
  }
  ~small_tmpfs() {
    if (mounted_) ::umount2(at_.c_str(), MNT_DETACH);
  }
  small_tmpfs(const small_tmpfs&) = delete;
  small_tmpfs& operator=(const small_tmpfs&) = delete;
  bool ok() const { return mounted_; }
  const std::string& why() const { return why_; }

 private:
  fs::path at_;
  bool mounted_ = false;
  std::string why_;
};

}  // namespace

TEST_CASE("Unknown flags of troupe train and troupe launch are refused naming the flag",
          "[multirank][faults]") {
  auto train = run_troupe({"train", "--demo", "--stepz", "3"});
  CHECK(train.code != 0);
  CHECK_THAT(train.output, Contains("unknown flag '--stepz'"));
  CHECK_THAT(train.output, !Contains("step "));  // nothing ran
  print_fault("troupe train --stepz", line_with(train.output, "--stepz"));
  auto launch = run_troupe({"launch", "--nprocz", "2", "--", troupe_bin, "train", "--demo"});
  CHECK(launch.code != 0);
  // (CLI11 alone would name only "/path/troupe train --demo": it takes --nprocz for a value.)
  CHECK_THAT(launch.output, Contains("unknown flag '--nprocz'"));
  print_fault("troupe launch --nprocz", line_with(launch.output, "--nprocz"));
}

TEST_CASE("Bad job files are refused naming the file, the line or the key", "[multirank][faults]") {
  scratch_dir dir("badjob");
  struct bad_job {
    const char* what;
    const char* text;
    std::string says;
  };
  const std::string job = dir.path + "/job.toml";
  for (const auto& [what, text, says] :
       {bad_job{"job file with a syntax error", "[train]\nsteps = 2\nbatch = = 4\n", job + ":3:"},
        bad_job{"job file with an unknown key", "[train]\nstepz = 2\n",
                "unknown key 'train.stepz'"},
        bad_job{"job file with a wrong type", "[train]\nsteps = \"two\"\n",
                "train.steps must be an integer"}}) {
    INFO(what);
    std::ofstream(job) << text;
    auto r = run_troupe({"train", "--config", job, "--sample", "0"});
    CHECK(r.code != 0);
    CHECK_THAT(r.output, Contains("troupe: error: " + job) && Contains(says));
    print_fault(what, line_with(r.output, "troupe: error:"));
  }
}

// A model folder (troupe generate --model, as troupe train --model-hf reads it) with a config.json
// of a wrong type or a missing field, a truncated or corrupt model.safetensors.
TEST_CASE("A bad model folder is refused naming the file, the field or the tensor",
          "[multirank][faults]") {
  scratch_dir dir("badmodel");
  const fs::path good = fs::path(TROUPE_SOURCE_DIR) / "tests" / "fixtures" / "hf" / "gpt2_bare";
  const fs::path m = fs::path(dir.path) / "model";
  const std::string config = read_file(good / "config.json"),
                    weights = read_file(good / "model.safetensors");
  auto replaced = [](std::string s, const std::string& from, const std::string& to) {
    const auto at = s.find(from);
    REQUIRE(at != std::string::npos);
    return s.replace(at, from.size(), to);
  };
  struct bad_model {
    const char* what;
    std::string config, weights, says;
  };
  // The header length (its first 8 bytes) stays; the ':' after "__metadata__" becomes '}'.
  std::string corrupt = weights;
  REQUIRE(corrupt.substr(8, 16) == "{\"__metadata__\":");
  corrupt[23] = '}';
  for (const auto& [what, cfg, w, says] :
       {bad_model{"config.json with n_layer a string",
                  replaced(config, "\"n_layer\": 2", "\"n_layer\": \"2\""), weights,
                  "field 'n_layer' must be an integer"},
        bad_model{"config.json without n_embd", replaced(config, "\"n_embd\": 8,", ""), weights,
                  "field 'n_embd' is missing"},
        bad_model{"truncated model.safetensors", config, weights.substr(0, weights.size() - 100),
                  "truncated"},
        bad_model{"model.safetensors with a corrupt header", config, corrupt, "not valid JSON"}}) {
    INFO(what);
    fs::create_directories(m);
    std::ofstream(m / "config.json", std::ios::trunc) << cfg;
    std::ofstream(m / "model.safetensors", std::ios::binary | std::ios::trunc) << w;
    auto r = run_troupe({"generate", "--model", m.string(), "--max-new", "2"});
    CHECK(r.code != 0);
    const std::string file = std::string(what).find("config") != std::string::npos
                                 ? (m / "config.json").string()
                                 : (m / "model.safetensors").string();
    CHECK_THAT(r.output, Contains("troupe: error:") && Contains(file) && Contains(says));
    print_fault(what, line_with(r.output, "troupe: error:"));
  }
}

// The folder is checked when the run is configured: refused before the first step (not after
// hours of training), naming the folder and the user's files, which stay as they were.
TEST_CASE("A checkpoint folder holding the user's files is refused before training starts",
          "[multirank][faults]") {
  scratch_dir dir("userck");
  const fs::path mine = fs::path(dir.path) / "mine";
  fs::create_directories(mine);
  std::ofstream(mine / "thesis.tex") << "my thesis";
  std::ofstream(mine / "results.csv") << "1,2,3";
  auto r = run_troupe(demo_run(2, {"--checkpoint-dir", mine.string()}));
  CHECK(r.code != 0);
  CHECK_THAT(r.output, Contains("checkpoint.dir (--checkpoint-dir)") &&
                           Contains(q(mine.string())) && Contains("'thesis.tex'") &&
                           Contains("'results.csv'"));
  CHECK_THAT(r.output, !Contains("step     1"));  // refused before the first step
  CHECK(read_file(mine / "thesis.tex") == "my thesis");
  CHECK(read_file(mine / "results.csv") == "1,2,3");
  CHECK_FALSE(fs::exists(dir.path + "/mine.partial"));
  print_fault("troupe train --checkpoint-dir <folder of user files>",
              line_with(r.output, "troupe: error:"));
  // A launched run refuses it as well, on rank 0, before its first step.
  auto l = run_troupe({"launch",     "-n",
                       "2",          "--quiet",
                       "--",         troupe_bin,
                       "train",      "--model",
                       "gpt2-demo",  "--steps",
                       "2",          "--batch",
                       "4",          "--seq",
                       "16",         "--dp",
                       "2",          "--sample",
                       "0",          "--threads",
                       "1",          "--checkpoint-dir",
                       mine.string()});
  CHECK(l.code != 0);
  CHECK_THAT(l.output, Contains(q(mine.string())) && Contains("'thesis.tex'"));
  CHECK_THAT(l.output, !Contains("step     1"));
  CHECK(read_file(mine / "thesis.tex") == "my thesis");
  print_fault("troupe launch -n 2 -- troupe train --checkpoint-dir <folder of user files>",
              line_with(l.output, "thesis.tex"));
}

// The demo's checkpoint is about 10 MB (weights 3.4 MB, AdamW moments 6.9 MB); on a 15 MiB tmpfs
// the first save fits and the second (written beside the first, which stays until the new one is
// whole) runs out of space.
TEST_CASE("A disk that fills during a checkpoint fails the save and keeps the previous one",
          "[multirank][faults]") {
  scratch_dir dir("fulldisk");
  const fs::path mnt = fs::path(dir.path) / "small";
  small_tmpfs disk(mnt, 15ull << 20);
  if (!disk.ok()) {
    WARN("troupe-skip: cannot mount a small tmpfs here (" << disk.why() << ")");
    return;
  }
  fs::create_directories(mnt / "mine");
  std::ofstream(mnt / "mine" / "notes.txt") << "the user's notes";
  const fs::path ck = mnt / "ck";
  auto r = run_troupe(demo_run(2, {"--checkpoint-every", "1", "--checkpoint-dir", ck.string()}));
  INFO(r.output);
  CHECK(r.code != 0);
  CHECK_THAT(r.output, Contains(std::string("checkpoint: step 1 saved in ") + q(ck.string())));
  const std::string err = line_with(r.output, "troupe: error:");
  CHECK_THAT(err, Contains("No space left on device") && Contains((mnt / "ck.partial").string()) &&
                      Contains(".safetensors.tmp") &&
                      Contains(std::string("(the checkpoint in ") + q(ck.string()) +
                               ", step 1, is unchanged)"));
  // Nothing half-written is left, the user's files are intact, and the step-1 checkpoint resumes.
  CHECK_FALSE(fs::exists(mnt / "ck.partial"));
  CHECK(read_file(mnt / "mine" / "notes.txt") == "the user's notes");
  auto resumed = run_troupe(demo_run(2, {"--resume", ck.string()}));
  CHECK(resumed.code == 0);
  CHECK_THAT(resumed.output, Contains("resumed " + ck.string() + " at step 1"));
  std::printf("faults: full disk (15 MiB tmpfs) during a checkpoint -> refused: %s\n", err.c_str());
}
