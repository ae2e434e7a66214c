// A rank holds its piece, never the whole model: a launched pp 2 run of `troupe train` (with a
// checkpoint at the end) reports for every rank the most parameter bytes it held at once
// (models/layers/slots.hpp's ledger: every layer_memory's params(), so a whole model built on the
// rank at any time - setup, loading, saving - would count in full); each stays under 60% of the
// whole model's (a stage of gpt2-demo holds about half of it), while the losses equal the single
// process's as far as f32 rounding goes (same_losses: as accurate as it against its f64 twin) and
// the checkpoint is written.
#include <catch2/catch.hpp>

#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;

namespace {

struct rank_memory {
  int rank = -1;
  double params = 0, whole = 0;
};

// The "rank R memory: parameters P bytes at peak (whole model W bytes" lines of a run's output.
std::vector<rank_memory> memory_lines(const std::string& out) {
  static const std::regex line(
      R"(rank (\d+) memory: parameters (\d+) bytes at peak \(whole model (\d+) bytes)");
  std::vector<rank_memory> got;
  for (auto it = std::sregex_iterator(out.begin(), out.end(), line); it != std::sregex_iterator();
       ++it)
    got.push_back({std::stoi((*it)[1]), std::stod((*it)[2]), std::stod((*it)[3])});
  return got;
}

}  // namespace

TEST_CASE("A launched pp 2 run holds only its stage's parameters and trains as one process does",
          "[multirank]") {
  scratch_dir dir("piece");
  const int steps = 3;
  auto want = single_and_twin("gpt2-demo", steps, dir.path);
  std::string out;
  auto got = launched(2, "gpt2-demo", steps, dir.path, "pp2",
                      {"--pp", "2", "--checkpoint-dir", dir.path + "/ck"}, &out);
  INFO(out);
  same_losses(got, want);
  CHECK(std::filesystem::exists(dir.path + "/ck/model.safetensors"));
  CHECK(std::filesystem::exists(dir.path + "/ck/optimizer.safetensors"));
  const auto mem = memory_lines(out);
  REQUIRE(mem.size() == 2);
  for (const auto& m : mem) {
    INFO("rank " << m.rank << ": " << m.params << " of " << m.whole << " parameter bytes");
    CHECK(m.whole > 3e6);             // gpt2-demo: about 0.86 M f32 parameters
    CHECK(m.params > 0.4 * m.whole);  // it holds its stage...
    CHECK(m.params < 0.6 * m.whole);  // ...and never the whole model
  }
}
