// The reward model against HF's LlamaForSequenceClassification and GPT2ForSequenceClassification
// (tests/fixtures/post/{llama,gpt2}_rm/, scripts/reference/make_post_fixtures.py): HF's weights
// load, the rewards of padded rows and the gradients of the Bradley-Terry loss through the model
// are as accurate as torch's (tests/rounding.hpp, against our f64 run of the same weights), and a
// saved folder has HF's names and loads back.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <filesystem>
#include <fstream>

#include "models/hf/config.hpp"
#include "models/hf/safetensors.hpp"
#include "models/post/central_differences.test.hpp"
#include "models/post/preference_loss.hpp"
#include "models/post/reward_model.hpp"
#include "models/post/reward_step.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
namespace fs = std::filesystem;

namespace {

struct run {
  std::vector<double> rewards;
  double loss = 0;
  std::map<std::string, std::vector<double>> grads;  // by our parameter name
};

std::vector<double> values(const tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  for (std::int64_t i = 0; i < t.numel(); ++i)
    out[i] = t.type() == dtype::f32 ? t.data_as<float>()[i] : t.data_as<double>()[i];
  return out;
}

// Rewards, the BT loss of rows (0 over 1, 2 over 3) and the gradients of `names` (our names; a
// [V + 1, C] head or embedding is cut to its HF part: the first V rows, or row V for the score).
run run_model(const fs::path& dir, dtype t, std::vector<std::int32_t>& ids,
              const std::vector<std::pair<std::string, std::string>>& names) {
  const auto cfg = hf::read_config(dir).value();
  reward_model m(cfg, batch_dims{4, 9}, 0, t);
  REQUIRE(m.load(dir).has_value());
  m.lm().memory().zero_grads();
  run r;
  r.rewards = m.forward(tensor(ids.data(), ids.size() * 4, dtype::i32, {4, 9}));
  const std::vector<double> c{r.rewards[0], r.rewards[2]}, j{r.rewards[1], r.rewards[3]};
  const reward_result bt = bradley_terry_loss(c, j);
  r.loss = bt.loss;
  m.backward(
      std::vector<double>{bt.d_chosen[0], bt.d_rejected[0], bt.d_chosen[1], bt.d_rejected[1]});
  for (const auto& [ours, part] : names)
    for (const auto& s : m.lm().slots().slots())
      if (s.name == ours) {
        tensor g = *s.grad;
        if (part == "score") g = g.narrow(0, m.vocab(), 1);
        if (part == "vocab") g = g.narrow(0, 0, m.vocab());
        r.grads[ours] = values(g);
      }
  return r;
}

void check_against_hf(const std::string& name,
                      const std::vector<std::pair<std::string, std::string>>& ours,
                      const std::vector<std::string>& theirs) {
  INFO(name);
  const fs::path dir = fs::path(TROUPE_SOURCE_DIR) / "tests/fixtures/post" / name;
  std::ifstream in(dir / "reward.json");
  REQUIRE(in.good());
  const auto ref = nlohmann::json::parse(in);
  std::vector<std::int32_t> ids;
  for (const auto& row : ref["ids"])
    for (const auto& x : row) ids.push_back(x.get<std::int32_t>());
  const run got = run_model(dir, dtype::f32, ids, ours);
  const run exact = run_model(dir, dtype::f64, ids, ours);
  // Ours in f32 and torch's f32 against our f64 run of the same weights, both ways (the f32
  // rule: each within default_k of the other's own error). A wrong pooled token, a missing
  // final norm or a score read from the wrong row is off by O(|reward|).
  auto both = [](const std::vector<double>& a, const std::vector<double>& b,
                 const std::vector<double>& x) {
    const auto v1 = tests::as_accurate_as(a, b, x), v2 = tests::as_accurate_as(b, a, x);
    INFO("ours: " << v1.str() << "; torch's: " << v2.str());
    CHECK(v1.ok());
    CHECK(v2.ok());
  };
  both(got.rewards, ref["rewards"].get<std::vector<double>>(), exact.rewards);
  both({got.loss}, {ref["loss"].get<double>()}, {exact.loss});
  for (std::size_t i = 0; i < ours.size(); ++i) {
    INFO(ours[i].first << " = " << theirs[i]);
    std::vector<double> hf = ref["grads"][theirs[i]].get<std::vector<double>>();
    const auto& mine = got.grads.at(ours[i].first);
    REQUIRE(hf.size() == mine.size());
    if (name == "gpt2_rm" && theirs[i].find("c_attn") != std::string::npos) {
      // Conv1D keeps [in, out]: ours is the transpose.
      std::vector<double> tr(hf.size());
      const std::size_t in = 16, out = hf.size() / 16;
      for (std::size_t a = 0; a < in; ++a)
        for (std::size_t b = 0; b < out; ++b) tr[b * in + a] = hf[a * out + b];
      hf = tr;
    }
    both(mine, hf, exact.grads.at(ours[i].first));
  }
}

}  // namespace

TEST_CASE("a reward model gives HF's rewards and Bradley-Terry gradients", "[cpu]") {
  check_against_hf("llama_rm",
                   {{"lm_head.weight", "score"},
                    {"layers.0.mlp.up_proj.weight", ""},
                    {"embed_tokens.weight", "vocab"},
                    {"norm.weight", ""}},
                   {"score.weight", "model.layers.0.mlp.up_proj.weight",
                    "model.embed_tokens.weight", "model.norm.weight"});
  check_against_hf("gpt2_rm",
                   {{"wte.weight", "score"},
                    {"h.0.attn.qkv_proj.weight", ""},
                    {"wpe.weight", ""},
                    {"ln_f.weight", ""}},
                   {"score.weight", "transformer.h.0.attn.c_attn.weight", "transformer.wpe.weight",
                    "transformer.ln_f.weight"});
}

TEST_CASE("a saved reward model has HF's names and loads back", "[cpu]") {
  const fs::path src = fs::path(TROUPE_SOURCE_DIR) / "tests/fixtures/post/llama_rm";
  const fs::path dir = fs::temp_directory_path() / ("troupe-rm-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const auto cfg = hf::read_config(src).value();
  reward_model a(cfg, batch_dims{4, 9}, 0), b(cfg, batch_dims{4, 9}, 0);
  REQUIRE(a.load(src).has_value());
  REQUIRE(a.save(dir).has_value());
  auto file = hf::safetensors_file::open(dir / "model.safetensors").value();
  auto theirs = hf::safetensors_file::open(src / "model.safetensors").value();
  CHECK(file.tensors().size() == theirs.tensors().size());
  for (const auto& e : theirs.tensors()) CHECK(file.find(e.name) != nullptr);
  const auto j = nlohmann::json::parse(std::ifstream(dir / "config.json"));
  CHECK(j["architectures"][0] == "LlamaForSequenceClassification");
  CHECK(j["num_labels"] == 1);
  REQUIRE(b.load(dir).has_value());
  std::vector<std::int32_t> ids(36, 5);
  tensor t(ids.data(), ids.size() * 4, dtype::i32, {4, 9});
  CHECK(a.forward(t) == b.forward(t));  // the same weights, the same kernels: bitwise
  fs::remove_all(dir);
}

TEST_CASE("a reward micro-batch backpropagates the Bradley-Terry loss", "[cpu]") {
  const fs::path src = fs::path(TROUPE_SOURCE_DIR) / "tests/fixtures/post/llama_rm";
  const auto cfg = hf::read_config(src).value();
  reward_model rm(cfg, batch_dims{4, 6}, 0, dtype::f64);
  REQUIRE(rm.load(src).has_value());
  auto rows = std::make_shared<preference_rows>();
  rows->seq = 6;
  for (std::int32_t i = 0; i < 24; ++i) {  // 2 pairs; rows padded with 0 after 3 + i % 4 tokens
    rows->ids.push_back(i % 6 < 3 + (i / 6) % 3 ? 1 + (i * 7) % 31 : 0);
    rows->targets.push_back(-100);
  }
  rm.lm().memory().zero_grads();
  reward_result seen;
  const double loss =
      reward_micro_batch(rows, rm, 2, [&](const reward_result& r) { seen = r; })(rm.lm(), 0, 1.0);
  CHECK(loss == seen.loss);
  std::vector<std::int32_t> ids, targets;
  preference_batch(*rows, 0, 2, ids, targets);
  auto loss_at = [&] {
    const auto r = rm.forward(tensor(ids.data(), ids.size() * 4, dtype::i32, {4, 6}));
    return bradley_terry_loss(std::vector<double>{r[0], r[1]}, std::vector<double>{r[2], r[3]})
        .loss;
  };
  CHECK(loss_at() == Approx(loss).epsilon(1e-14));
  // f64 central differences (central_differences.test.hpp): they separate rounding and
  // truncation from a misplaced or misweighted score gradient.
  const tensor& p = rm.lm().memory().params();
  const tensor& g = rm.lm().memory().grads();
  std::vector<std::int64_t> at;
  for (std::int64_t k = 0, i = 7; k < 40; ++k, i = (i * 7919 + 13) % p.numel()) at.push_back(i);
  models::testing::check_central_differences(p, g, at, loss_at);
}
