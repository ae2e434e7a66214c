// troupe generate through the binary: the batched mode (--num-samples N: N completions of the
// prompt decoded together through the kv cache, the rollout actors' sampling) against the one-row
// streaming path, on the HF Llama fixture (vocabulary 96: byte ids below it decode as ASCII).
#include <fmt/core.h>
#include <catch2/catch.hpp>

#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "tests/multirank/rl_command.hpp"

using namespace troupe::tests;
using Catch::Contains;
namespace fs = std::filesystem;

namespace {

const std::string fixture =
    (fs::path(TROUPE_SOURCE_DIR) / "tests" / "fixtures" / "models" / "llama").string();

// The samples of a batched output of n rows: "[r] <prompt><completion>\n" each (a completion may
// hold newlines, so rows are cut at the next row's "\n[r + 1] ").
std::vector<std::string> samples_of(const std::string& out, int n) {
  std::vector<std::string> s;
  std::size_t at = 0;
  for (int r = 0; r < n; ++r) {
    const std::string head = fmt::format("[{}] ", r);
    at = out.find(head, at);
    if (at == std::string::npos) break;
    at += head.size();
    const auto end = r + 1 < n ? out.find(fmt::format("\n[{}] ", r + 1), at) : out.rfind('\n');
    s.push_back(out.substr(at, end - at));
    at = end;
  }
  return s;
}

// The line of `out` holding `needle` ("" when none).
std::string line_with(const std::string& out, const std::string& needle) {
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);)
    if (line.find(needle) != std::string::npos) return line;
  return "";
}

}  // namespace

TEST_CASE("Batched troupe generate decodes each greedy row as the one-row path does",
          "[multirank]") {
  // Greedy decoding is a function of the prompt alone, so every row of the batch must equal the
  // one-row stream: a row that read another row's kv cache, or positions shifted by the batch,
  // would differ (the fixture's random weights make neighbouring continuations distinct).
  const std::vector<std::string> common = {"generate", "--model",  fixture,     "--prompt",
                                           "AB",       "--greedy", "--max-new", "12"};
  auto one = run_troupe(common);
  REQUIRE(one.code == 0);
  // The prompt, then 12 tokens (the fixture has no eos; a token may be any byte below 96, a
  // newline too), then a newline.
  REQUIRE(one.output.size() == 2 + 12 + 1);
  const std::string stream = one.output.substr(0, 14);

  auto args = common;
  for (const char* a : {"--num-samples", "3", "--stats", "--repeat", "2"}) args.push_back(a);
  auto batch = run_troupe(args);
  REQUIRE(batch.code == 0);
  std::string rows;
  for (int r = 0; r < 3; ++r) rows += fmt::format("[{}] {}\n", r, stream);
  CHECK(batch.output.starts_with(rows));
  CHECK_THAT(
      batch.output.substr(std::min(rows.size(), batch.output.size())),
      Contains("generated 36 new tokens in 3 rows decoding together") && Contains("tokens/s"));
}

TEST_CASE("Batched troupe generate samples different rows and a seed fixes them", "[multirank]") {
  const std::vector<std::string> common = {"generate", "--model",       fixture, "--prompt",
                                           "AB",       "--max-new",     "12",    "--num-samples",
                                           "4",        "--temperature", "2"};
  auto a = run_troupe(common), b = run_troupe(common);
  REQUIRE(a.code == 0);
  REQUIRE(b.code == 0);
  const auto ra = samples_of(a.output, 4), rb = samples_of(b.output, 4);
  REQUIRE(ra.size() == 4);
  CHECK(ra == rb);  // one sampler draws the rows in order: the seed fixes the whole batch
  // Rows sampled at temperature 2 from one prompt: not all alike (a batch that repeated row 0's
  // draws would be).
  CHECK(std::set<std::string>(ra.begin(), ra.end()).size() > 1);
}

TEST_CASE("troupe generate refuses --repeat without a batch naming the flags",
          "[multirank][faults]") {
  auto r = run_troupe({"generate", "--model", fixture, "--max-new", "2", "--repeat", "3"});
  CHECK(r.code != 0);
  CHECK_THAT(r.output, Contains("--repeat") && Contains("--num-samples"));
  std::printf("faults: troupe generate --repeat 3 without --num-samples -> refused: %s\n",
              line_with(r.output, "troupe: error:").c_str());
}
