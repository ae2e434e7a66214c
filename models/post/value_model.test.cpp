// The critic's value head (value_model.hpp) on HF's LlamaForSequenceClassification fixture
// (tests/fixtures/post/llama_rm/, proven against HF by reward_model.test.cpp): the value at every
// position is the reward HF pools when the row ends there, and a saved critic has HF's layout and
// loads back to the same values.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "models/hf/safetensors.hpp"
#include "models/post/value_model.hpp"

using namespace troupe;
using namespace troupe::models;
namespace fs = std::filesystem;

namespace {

const fs::path fixture = fs::path(TROUPE_SOURCE_DIR) / "tests/fixtures/post/llama_rm";

}  // namespace

TEST_CASE("a value model's value at each position is the reward of the row ending there", "[cpu]") {
  const auto cfg = hf::read_config(fixture).value();
  value_model v(cfg, batch_dims{8, 9}, /*pad_id=*/0, dtype::f64);
  REQUIRE(v.scored().load(fixture).has_value());
  reward_model rm(cfg, batch_dims{8, 9}, 0, dtype::f64);
  REQUIRE(rm.load(fixture).has_value());
  // One row without pads, its values at positions 0..7; row p of the reward model's batch is the
  // same row with a pad at p + 1, so HF pools its score at position p.
  std::vector<std::int32_t> row{5, 17, 3, 9, 30, 2, 11, 7, 21};
  std::vector<std::int32_t> ids;
  for (int p = 0; p < 8; ++p) {
    std::vector<std::int32_t> r = row;
    r[static_cast<std::size_t>(p) + 1] = 0;
    ids.insert(ids.end(), r.begin(), r.end());
  }
  std::vector<std::int32_t> same;
  for (int p = 0; p < 8; ++p) same.insert(same.end(), row.begin(), row.end());
  const auto values = v.forward(tensor(same.data(), same.size() * 4, dtype::i32, {8, 9}));
  const auto rewards = rm.forward(tensor(ids.data(), ids.size() * 4, dtype::i32, {8, 9}));
  REQUIRE(values.size() == 72);
  double spread = 0;
  for (std::size_t p = 0; p < 8; ++p) {
    INFO("position " << p);
    // Causal attention: position p's hidden state does not see the tokens after it, so the two
    // f64 runs compute the same sums in the same order (equal up to a few ulps of O(1) values).
    CHECK(values[p] == Approx(rewards[p]).margin(1e-12));
    spread = std::max(spread, std::abs(values[p] - values[0]));
  }
  CHECK(spread > 1e-3);  // the positions' values differ: a per-token head, not one pooled score
}

TEST_CASE("a saved value model has HF's sequence-classification layout and loads back", "[cpu]") {
  const auto cfg = hf::read_config(fixture).value();
  value_model a(cfg, batch_dims{2, 9}, 0);
  a.lm().init_weights(5);  // a new score head, as the critic starts
  REQUIRE(a.scored().load(fixture, /*need_score=*/false).has_value());
  const fs::path dir = fs::temp_directory_path() / ("troupe-value-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  REQUIRE(a.scored().save(dir).has_value());
  auto file = hf::safetensors_file::open(dir / "model.safetensors");
  REQUIRE(file.has_value());
  CHECK(file->find("score.weight") != nullptr);
  CHECK(file->find("lm_head.weight") == nullptr);
  std::ifstream in(dir / "config.json");
  const auto j = nlohmann::json::parse(in);
  CHECK(j["architectures"][0] == "LlamaForSequenceClassification");
  CHECK(j["num_labels"] == 1);

  value_model b(cfg, batch_dims{2, 9}, 0);
  REQUIRE(b.scored().load(dir).has_value());
  std::vector<std::int32_t> ids{5, 17, 3, 9, 30, 2, 11, 7, 21, 4, 4, 8, 1, 19, 6, 2, 2, 13};
  const tensor t(ids.data(), ids.size() * 4, dtype::i32, {2, 9});
  CHECK(a.forward(t) == b.forward(t));  // f32 weights saved as f32: the same model, bit for bit
  fs::remove_all(dir);
}
