// config.json: GPT-2 and Llama configs parsed with HF's defaults, errors that name the file and the
// field, and configs written back and read again.
#include <catch2/catch.hpp>

#include <cstdio>

#include "models/hf/config.hpp"
#include "models/hf/testing.hpp"

using namespace troupe;
using namespace troupe::models::hf;
using namespace troupe::models::hf::testing;
using Catch::Contains;

namespace {

const std::string llama_json = R"({
  "model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 160,
  "num_hidden_layers": 3, "num_attention_heads": 8, "max_position_embeddings": 128,
  "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2})";

std::string parse_error(const std::string& text) {
  auto c = parse_config(text, "/models/x/config.json");
  REQUIRE_FALSE(c.has_value());
  CHECK_THAT(c.error_message(), Contains("/models/x/config.json"));
  return c.error_message();
}

// llama_json with one field replaced (or added).
std::string llama_with(const std::string& field, const std::string& value) {
  std::string s = llama_json;
  std::string key = "\"" + field + "\": ";
  auto at = s.find(key);
  if (at == std::string::npos) return s.substr(0, s.size() - 1) + ", " + key + value + "}";
  auto end = s.find_first_of(",}", at);
  return s.substr(0, at) + key + value + s.substr(end);
}

}  // namespace

TEST_CASE("The GPT-2 config written by transformers parses", "[cpu]") {
  auto c = read_config(fixture_dir() / "gpt2");
  REQUIRE(c.has_value());
  const auto& g = std::get<gpt2_config>(*c);
  CHECK(g.vocab_size == 16);
  CHECK(g.n_positions == 8);
  CHECK(g.n_embd == 8);
  CHECK(g.n_layer == 2);
  CHECK(g.n_head == 2);
  CHECK(g.layer_norm_epsilon == 1e-5);
  CHECK(g.activation_function == "gelu_new");
  CHECK(g.tie_word_embeddings);
  auto m = to_gpt_config(g);
  CHECK(m.vocab == 16);
  CHECK(m.max_seq == 8);
  CHECK(m.dim == 8);
  CHECK(m.ln_eps == 1e-5);
}

TEST_CASE("A Llama config takes HF's defaults for the optional fields", "[cpu]") {
  auto c = parse_config(llama_json, "config.json");
  REQUIRE(c.has_value());
  const auto& l = std::get<llama_config>(*c);
  CHECK(l.vocab_size == 100);
  CHECK(l.hidden_size == 64);
  CHECK(l.intermediate_size == 160);
  CHECK(l.num_hidden_layers == 3);
  CHECK(l.num_attention_heads == 8);
  CHECK(l.num_key_value_heads == 8);  // default: num_attention_heads
  CHECK(l.head_dim == 8);             // default: hidden / heads
  CHECK(l.max_position_embeddings == 128);
  CHECK(l.rms_norm_eps == 1e-5);
  CHECK(l.rope_theta == 10000.0);
  CHECK_FALSE(l.tie_word_embeddings);
  CHECK_FALSE(l.attention_bias);

  auto g = parse_config(llama_with("num_key_value_heads", "2"), "config.json");
  REQUIRE(g.has_value());
  CHECK(std::get<llama_config>(*g).num_key_value_heads == 2);
  auto t = parse_config(llama_with("rope_theta", "500000.0"), "config.json");
  CHECK(std::get<llama_config>(*t).rope_theta == 500000.0);
  auto n = parse_config(llama_with("rope_scaling", "null"), "config.json");
  CHECK(n.has_value());
}

TEST_CASE("Config errors name the file and the field", "[cpu][faults]") {
  // The fault matrix's line for a case (ctest -L faults).
  auto refused = [](const char* what, std::string message) {
    std::printf("faults: config.json %s -> refused: %s\n", what, message.c_str());
    return message;
  };
  CHECK_THAT(parse_error("{not json"), Contains("not valid JSON"));
  CHECK_THAT(parse_error("[1]"), Contains("not a JSON object"));
  CHECK_THAT(refused("without model_type", parse_error(R"({"vocab_size": 5})")),
             Contains("field 'model_type' is missing"));
  CHECK_THAT(parse_error(R"({"model_type": "bert"})"),
             Contains("field 'model_type'") && Contains("supported: gpt2, llama"));

  const std::string gpt2 = R"({"model_type": "gpt2", "vocab_size": 50, "n_positions": 16,
                               "n_embd": 32, "n_layer": 2, "n_head": 4)";
  REQUIRE(parse_config(gpt2 + "}", "c").has_value());
  CHECK_THAT(refused("without n_embd", parse_error(R"({"model_type": "gpt2", "vocab_size": 50,
                               "n_positions": 16, "n_layer": 2, "n_head": 4})")),
             Contains("field 'n_embd' is missing"));
  CHECK_THAT(refused("n_layer a string", parse_error(gpt2 + R"(, "n_layer": "2"})")),
             Contains("field 'n_layer' must be an integer, got \"2\""));
  CHECK_THAT(parse_error(gpt2 + R"(, "activation_function": "relu"})"),
             Contains("field 'activation_function'") && Contains("only gelu_new"));
  CHECK_THAT(parse_error(gpt2 + R"(, "layer_norm_epsilon": "small"})"),
             Contains("field 'layer_norm_epsilon' must be a number"));
  CHECK_THAT(parse_error(gpt2 + R"(, "n_head": 5})"),
             Contains("field 'n_embd'") && Contains("multiple of n_head"));
  CHECK_THAT(parse_error(gpt2 + R"(, "tie_word_embeddings": false})"),
             Contains("field 'tie_word_embeddings'"));
  CHECK_THAT(parse_error(gpt2 + R"(, "n_inner": 100})"), Contains("field 'n_inner'"));

  CHECK_THAT(parse_error(llama_with("hidden_act", "\"gelu\"")),
             Contains("field 'hidden_act'") && Contains("only silu"));
  CHECK_THAT(parse_error(llama_with("rope_scaling", R"({"type": "linear", "factor": 2.0})")),
             Contains("field 'rope_scaling'") && Contains("not supported"));
  CHECK_THAT(parse_error(llama_with("num_key_value_heads", "3")),
             Contains("field 'num_key_value_heads'") && Contains("must divide"));
  CHECK_THAT(parse_error(llama_with("vocab_size", "0")),
             Contains("field 'vocab_size' must be positive"));
  CHECK_THAT(refused("vocab_size 1.5", parse_error(llama_with("vocab_size", "1.5"))),
             Contains("field 'vocab_size' must be an integer, got 1.5"));
  CHECK_THAT(parse_error(llama_with("rms_norm_eps", "-1")),
             Contains("field 'rms_norm_eps' must be positive"));
  CHECK_THAT(parse_error(llama_with("attention_bias", "1")),
             Contains("field 'attention_bias' must be true or false"));
  CHECK_THAT(parse_error(llama_with("mlp_bias", "true")), Contains("field 'mlp_bias'"));
  CHECK_THAT(parse_error(replace_first(llama_json, "\"rms_norm_eps\": 1e-5,", "")),
             Contains("field 'rms_norm_eps' is missing"));

  auto missing = read_config(fixture_dir() / "absent");
  REQUIRE_FALSE(missing.has_value());
  CHECK_THAT(missing.error_message(), Contains("absent") && Contains("cannot open"));
}

TEST_CASE("A config written back reads the same and keeps the fields troupe ignores", "[cpu]") {
  temp_dir dir;
  auto l = parse_config(llama_with("num_key_value_heads", "4"), "config.json");
  REQUIRE(l.has_value());
  std::get<llama_config>(*l).tie_word_embeddings = true;
  auto written = write_config(dir.path(), *l, dtype::bf16);
  REQUIRE(written.has_value());
  CHECK(*written == dir / "config.json");
  const std::string text = read_bytes(dir / "config.json");
  CHECK_THAT(text, Contains("\"bos_token_id\": 1") && Contains("\"torch_dtype\": \"bfloat16\"") &&
                       Contains("LlamaForCausalLM"));
  auto back = read_config(dir.path());
  REQUIRE(back.has_value());
  const auto& a = std::get<llama_config>(*l);
  const auto& b = std::get<llama_config>(*back);
  CHECK(b.num_key_value_heads == 4);
  CHECK(b.tie_word_embeddings);
  CHECK(b.hidden_size == a.hidden_size);
  CHECK(b.head_dim == a.head_dim);
  CHECK(b.rms_norm_eps == a.rms_norm_eps);
  CHECK(b.rope_theta == a.rope_theta);

  gpt2_config g{.vocab_size = 40, .n_positions = 12, .n_embd = 16, .n_layer = 3, .n_head = 2};
  REQUIRE(write_config(dir.path(), g).has_value());
  auto gb = read_config(dir / "config.json");
  REQUIRE(gb.has_value());
  const auto& h = std::get<gpt2_config>(*gb);
  CHECK(h.vocab_size == 40);
  CHECK(h.n_positions == 12);
  CHECK(h.n_embd == 16);
  CHECK(h.n_layer == 3);
  CHECK(h.n_head == 2);
  CHECK(list_files(dir.path()) == std::vector<std::string>{"config.json"});
}
