// Tests of the MoE family (models/moe.hpp) beyond the HF parity of models/hf_reference.test.cpp:
// HF checkpoints with per-expert names saved sharded and read back, the config fields troupe
// refuses, the aux loss's place in the loss, recompute and the load statistics.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/config.hpp"
#include "models/layers/testing.hpp"
#include "models/moe.hpp"
#include "models/targets.hpp"
#include "models/train_loop.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;
namespace fs = std::filesystem;

namespace {

fs::path fixture_dir(const std::string& name) {
  return fs::path(TROUPE_SOURCE_DIR) / "tests" / "fixtures" / "models" / name;
}

struct temp_dir {
  fs::path path;
  explicit temp_dir(const std::string& tag)
      : path(fs::temp_directory_path() /
             ("troupe-moe-" + tag + "-" + std::to_string(reinterpret_cast<std::uintptr_t>(this)))) {
    fs::remove_all(path);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

hf::moe_config read_moe(const fs::path& dir) {
  auto c = hf::read_config(dir);
  INFO((c ? std::string() : c.error_message()));
  REQUIRE(c);
  REQUIRE(std::holds_alternative<hf::moe_config>(c.value()));
  return std::get<hf::moe_config>(c.value());
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A small MoE for the tests that need no checkpoint.
moe_config small(bool aux, bool recompute = false) {
  return {.vocab = 32,
          .dim = 16,
          .n_layer = 2,
          .n_head = 2,
          .max_seq = 8,
          .expert_hidden = 12,
          .n_expert = 4,
          .top_k = 2,
          .router_aux_loss_coef = 0.1,
          .aux_loss = aux,
          .init_std = 0.3,
          .recompute = recompute};
}

struct batch {
  std::vector<std::int32_t> ids, targets;
  tensor t_ids, t_targets;
  batch(std::int64_t b, std::int64_t t, std::int64_t vocab) : ids(b * t), targets(b * t) {
    for (std::size_t i = 0; i < ids.size(); ++i)
      ids[i] = static_cast<std::int32_t>((i * 7 + 3) % vocab);
    t_ids = tensor(ids.data(), ids.size() * 4, dtype::i32, {b, t});
    t_targets = tensor(targets.data(), targets.size() * 4, dtype::i32, {b, t});
    next_token_targets(t_ids, t_targets);
  }
};

}  // namespace

TEST_CASE("MoE checkpoints save in HF's sharded layout with per-expert names and load back",
          "[cpu]") {
  for (const char* name : {"mixtral_tiny", "qwen2_moe_tiny"}) {
    INFO("fixture " << name);
    const hf::model_config cfg = read_moe(fixture_dir(name));
    auto a = make_causal_lm(cfg, {1, 4}, dtype::f64);
    auto files = hf::load_weights(fixture_dir(name), cfg, a->slots());
    INFO((files ? std::string() : files.error_message()));
    REQUIRE(files);
    temp_dir dir(name);
    auto saved = hf::save_checkpoint(dir.path, cfg, a->slots(), {.max_shard_bytes = 16 << 10});
    INFO((saved ? std::string() : saved.error_message()));
    REQUIRE(saved);
    REQUIRE(fs::exists(dir.path / "model.safetensors.index.json"));
    CHECK(saved.value().size() > 3);  // several shards, the index, config.json
    const std::string index = read_text(dir.path / "model.safetensors.index.json");
    const bool mixtral = std::string(name) == "mixtral_tiny";
    for (const char* tensor_name :
         mixtral ? std::vector<const char*>{"model.layers.1.block_sparse_moe.gate.weight",
                                            "model.layers.0.block_sparse_moe.experts.3.w1.weight",
                                            "model.layers.1.block_sparse_moe.experts.0.w2.weight",
                                            "model.layers.1.block_sparse_moe.experts.2.w3.weight"}
                 : std::vector<const char*>{"model.layers.1.mlp.gate.weight",
                                            "model.layers.0.mlp.experts.3.down_proj.weight",
                                            "model.layers.1.mlp.shared_expert.up_proj.weight",
                                            "model.layers.0.mlp.shared_expert_gate.weight",
                                            "model.layers.0.self_attn.k_proj.bias"}) {
      INFO(tensor_name);
      CHECK(index.find(tensor_name) != std::string::npos);
    }
    const hf::moe_config back = read_moe(dir.path);
    const hf::moe_config& orig = std::get<hf::moe_config>(cfg);
    CHECK(back.model_type == orig.model_type);
    CHECK(back.num_experts == orig.num_experts);
    CHECK(back.expert_size() == orig.expert_size());
    CHECK(back.shared_expert_intermediate_size == orig.shared_expert_intermediate_size);
    CHECK(back.norm_topk_prob == orig.norm_topk_prob);
    CHECK(back.output_router_logits == orig.output_router_logits);
    CHECK(back.router_aux_loss_coef == orig.router_aux_loss_coef);
    auto b = make_causal_lm(hf::model_config(back), {1, 4}, dtype::f64);
    auto loaded = hf::load_weights(dir.path, hf::model_config(back), b->slots());
    INFO((loaded ? std::string() : loaded.error_message()));
    REQUIRE(loaded);
    CHECK(values(a->memory().params()) == values(b->memory().params()));
  }
}

TEST_CASE("MoE config fields troupe does not implement are refused naming the field",
          "[cpu][faults]") {
  const std::string mixtral = read_text(fixture_dir("mixtral_tiny") / "config.json");
  const std::string qwen = read_text(fixture_dir("qwen2_moe_tiny") / "config.json");
  auto with = [](std::string text, const std::string& key, const std::string& value) {
    const auto at = text.find("\"" + key + "\"");
    if (at == std::string::npos)
      return text.insert(text.find('{') + 1, "\"" + key + "\": " + value + ",");
    const auto colon = text.find(':', at), end = text.find_first_of(",}", colon);
    return text.replace(colon + 1, end - colon - 1, " " + value);
  };
  const struct {
    const char* what;
    std::string text;
    const char* field;
  } cases[] = {
      {"router_jitter_noise 0.1", with(mixtral, "router_jitter_noise", "0.1"),
       "router_jitter_noise"},
      {"sliding_window 16 < 32", with(mixtral, "sliding_window", "16"), "sliding_window"},
      {"num_experts_per_tok 5 of 4", with(mixtral, "num_experts_per_tok", "5"),
       "num_experts_per_tok"},
      {"decoder_sparse_step 2", with(qwen, "decoder_sparse_step", "2"), "decoder_sparse_step"},
      {"mlp_only_layers [1]", with(qwen, "mlp_only_layers", "[1]"), "mlp_only_layers"},
      {"use_sliding_window true", with(qwen, "use_sliding_window", "true"), "use_sliding_window"},
      {"rope_scaling linear",
       with(qwen, "rope_scaling", R"({"rope_type": "linear", "factor": 2.0})"), "rope_scaling"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    auto parsed = hf::parse_config(c.text, "/m/config.json");
    REQUIRE_FALSE(parsed);
    const std::string message = parsed.error_message();
    CHECK(message.find(std::string("'") + c.field + "'") != std::string::npos);
    CHECK(message.find("/m/config.json") != std::string::npos);
    std::printf("faults: config.json %s -> refused: %s\n", c.what, message.c_str());
  }
  // The unmodified configs parse (the edits above are what is refused).
  CHECK(hf::parse_config(mixtral, "mixtral"));
  CHECK(hf::parse_config(qwen, "qwen"));
}

TEST_CASE("The aux loss enters the loss only with output_router_logits, times its coefficient",
          "[cpu]") {
  batch data(2, 8, 32);
  moe with(small(true), {2, 8}, dtype::f64), without(small(false), {2, 8}, dtype::f64);
  with.init_weights(5);
  without.init_weights(5);
  const double l_with = with.forward(data.t_ids, data.t_targets);
  const double l_without = without.forward(data.t_ids, data.t_targets);
  // aux = n_expert * sum_e f_e P_e >= top_k (its value at perfect balance is top_k).
  CHECK(with.aux_loss() >= 2.0 - 1e-12);
  CHECK(with.aux_loss() == without.aux_loss());
  CHECK(std::abs(l_with - (l_without + 0.1 * with.aux_loss())) <= 1e-12);
  // Load statistics: 2 layers x 16 tokens x top-2 choices.
  const moe_load load = with.load();
  REQUIRE(load.selected.size() == 4);
  CHECK(load.choices == 2 * 16 * 2);
  CHECK(std::accumulate(load.selected.begin(), load.selected.end(), std::int64_t{0}) == 64);
  CHECK(load.dropped == 0);
}

TEST_CASE("An MoE model with recompute computes the same loss and gradients bit for bit", "[cpu]") {
  batch data(2, 8, 32);
  moe plain(small(true), {2, 8}, dtype::f64), again(small(true, true), {2, 8}, dtype::f64);
  plain.init_weights(6);
  again.init_weights(6);
  for (moe* m : {&plain, &again}) m->memory().zero_grads();
  const double a = plain.forward(data.t_ids, data.t_targets);
  const double b = again.forward(data.t_ids, data.t_targets);
  plain.backward();
  again.backward();
  CHECK(a == b);
  CHECK(values(plain.memory().grads()) == values(again.memory().grads()));
}

TEST_CASE("model.moe_capacity_factor reaches an MoE model and is refused for a dense one",
          "[cpu][faults]") {
  train_config cfg;
  cfg.model_size = "mixtral-tiny";
  cfg.moe_capacity_factor = 1.25;
  const hf::model_config m = model_config_of(cfg);
  REQUIRE(std::holds_alternative<hf::moe_config>(m));
  CHECK(to_moe_config(std::get<hf::moe_config>(m)).capacity_factor == 1.25);
  // Not written to config.json: a checkpoint stays an HF config.
  CHECK(hf::config_json(m).find("capacity") == std::string::npos);
  cfg.model_size = "llama-tiny";
  try {
    (void)model_config_of(cfg);
    FAIL("a capacity factor for a dense model was accepted");
  } catch (const troupe::error& e) {
    const std::string message = e.what();
    CHECK(message.find("model.moe_capacity_factor") != std::string::npos);
    std::printf("faults: model.moe_capacity_factor on llama-tiny -> refused: %s\n", e.what());
  }
}

TEST_CASE("An MoE model's causal_lm reports its expert load; a dense one reports none", "[cpu]") {
  batch data(2, 8, 32);
  moe_config c = small(true);
  c.capacity_factor = 0.5;  // 16 rows x top-2 over 4 experts: 4 rows each
  causal_lm_of<moe> m(c, batch_dims{2, 8}, dtype::f64);
  m.init_weights(3);
  m.forward(data.t_ids, data.t_targets);
  const moe_load load = m.model().load();
  // Every expert is at most full (2 layers x 4 rows), the rest dropped and counted.
  std::int64_t over = 0;
  for (auto n : load.selected) over += std::max<std::int64_t>(0, n - 2 * 4);
  CHECK(load.dropped >= over);
  // 2 layers x 32 choices, at most 4 experts x 4 rows served per layer.
  CHECK(load.choices == 64);
  CHECK(load.choices - load.dropped <= 2 * 4 * 4);
  const std::string line = m.load_line();
  INFO(line);
  CHECK(line.find("expert choices") == 0);
  CHECK(line.find("dropped " + std::to_string(load.dropped)) != std::string::npos);
  auto dense = make_causal_lm(named_model_config("llama-tiny").value(), {1, 4});
  CHECK(dense->load_line().empty());
}
