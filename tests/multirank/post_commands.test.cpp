// troupe sft and troupe dpo through the binary as a user runs them: the sample data of
// examples/post/ trains (the loss falls), --json carries the steps (DPO: TRL's metric names), the
// checkpoints are HF folders that troupe eval loads, DPO starts from the SFT checkpoint, and bad
// data or an unknown template is refused by name. Each refusal prints its "faults:" line.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;
using Catch::Contains;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

struct run_result {
  int code = -1;
  std::string output;
};

run_result run_troupe(std::vector<std::string> args) {
  args.insert(args.begin(), troupe_bin);
  child_process p(args);
  auto st = p.wait(120s);
  INFO(p.output());
  REQUIRE(st.has_value());
  return {child_process::code(*st), p.output()};
}

std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

const std::string examples = std::string(TROUPE_SOURCE_DIR) + "/examples/post/";

}  // namespace

TEST_CASE("troupe sft then troupe dpo train the sample data into HF checkpoints", "[multirank]") {
  scratch_dir dir("post");
  const std::string sft = dir.path + "/sft", dpo = dir.path + "/dpo";
  const auto s =
      run_troupe({"sft", "--data", examples + "chat.jsonl", "--steps", "30", "--lr", "3e-3",
                  "--threads", "1", "--checkpoint-dir", sft, "--json", dir.path + "/sft.json"});
  INFO(s.output);
  REQUIRE(s.code == 0);
  CHECK_THAT(s.output, Contains("48 conversations in") && Contains("(packed)"));
  const auto steps = json_lines(dir.path + "/sft.json");
  REQUIRE(steps.size() == 30);
  // From ln(vocab) ~ 5.6 at the start; the answers are short sums the model learns quickly.
  CHECK(steps.back()["loss"].get<double>() < 0.5 * steps.front()["loss"].get<double>());
  REQUIRE(fs::exists(sft + "/model.safetensors"));
  REQUIRE(fs::exists(sft + "/config.json"));
  // The checkpoint loads as an HF folder elsewhere (a vocabulary past the bytes: 258 ids).
  const auto e = run_troupe(
      {"eval", "--model", sft, "--text", examples + "chat.jsonl", "--seq", "64", "--batches", "2"});
  INFO(e.output);
  CHECK(e.code == 0);

  const auto d = run_troupe({"dpo", "--data", examples + "pairs.jsonl", "--model-hf", sft, "--seq",
                             "64", "--steps", "10", "--threads", "1", "--checkpoint-dir", dpo,
                             "--json", dir.path + "/dpo.json"});
  INFO(d.output);
  REQUIRE(d.code == 0);
  const auto dsteps = json_lines(dir.path + "/dpo.json");
  REQUIRE(dsteps.size() == 10);
  // Step 1: the policy is the reference, so every log-ratio is 0 and the loss is ln 2.
  CHECK(dsteps.front()["loss"].get<double>() == Approx(std::log(2.0)).epsilon(1e-6));
  CHECK(dsteps.front()["rewards/margins"].get<double>() == 0.0);
  for (const char* key : {"rewards/chosen", "rewards/rejected", "rewards/accuracies"})
    CHECK(dsteps.back().contains(key));
  CHECK(fs::exists(dpo + "/model.safetensors"));

  // A reward model from the SFT checkpoint (a new score), saved in HF's sequence-classification
  // layout.
  const std::string rm = dir.path + "/rm";
  const auto r = run_troupe({"rm", "--data", examples + "pairs.jsonl", "--model-hf", sft, "--seq",
                             "64", "--steps", "5", "--threads", "1", "--checkpoint-dir", rm});
  INFO(r.output);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.output, Contains("accuracy"));
  std::ifstream cj(rm + "/config.json");
  const auto j = nlohmann::json::parse(cj);
  CHECK(j["architectures"][0] == "LlamaForSequenceClassification");
  CHECK(j["num_labels"] == 1);
}

TEST_CASE("troupe sft and dpo refuse bad data naming the file and line", "[multirank][faults]") {
  scratch_dir dir("post-bad");
  const std::string chat = dir.path + "/chat.jsonl", pairs = dir.path + "/pairs.jsonl";
  std::ofstream(chat) << R"({"messages": [{"role": "user", "content": "hi"}]})"
                      << "\n"
                      << R"({"messages": [{"role": "robot", "content": "x"}]})"
                      << "\n";
  std::ofstream(pairs) << R"({"prompt": "a", "chosen": "b"})"
                       << "\n";
  const auto s = run_troupe({"sft", "--data", chat, "--steps", "1"});
  CHECK(s.code != 0);
  CHECK_THAT(s.output, Contains(chat + ":2: ") && Contains("unknown role 'robot'"));
  std::printf("faults: troupe sft with an unknown role -> refused: %s",
              s.output.substr(s.output.find(chat)).c_str());
  const auto d = run_troupe({"dpo", "--data", pairs, "--steps", "1"});
  CHECK(d.code != 0);
  CHECK_THAT(d.output, Contains(pairs + ":1: ") && Contains("no \"rejected\""));
  std::printf("faults: troupe dpo with a pair missing a side -> refused: %s",
              d.output.substr(d.output.find(pairs)).c_str());
  const auto t = run_troupe({"sft", "--data", examples + "chat.jsonl", "--template", "alpaca"});
  CHECK(t.code != 0);
  CHECK_THAT(t.output, Contains("--template") && Contains("llama3 or chatml"));
}

TEST_CASE("troupe sft reads a job file and the flags given override it", "[multirank]") {
  scratch_dir dir("post-job");
  const std::string ck = dir.path + "/ck";
  // The file says 40 steps, seq 128 and /tmp/troupe-sft; the flags change steps and the folder.
  const auto s =
      run_troupe({"sft", "--config", examples + "sft.toml", "--data", examples + "chat.jsonl",
                  "--steps", "3", "--threads", "1", "--checkpoint-dir", ck});
  INFO(s.output);
  REQUIRE(s.code == 0);
  CHECK_THAT(s.output, Contains("rows of 128 tokens") && Contains("step     3/3"));
  CHECK(fs::exists(ck + "/model.safetensors"));
}
