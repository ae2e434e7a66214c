// config.json: GPT-2 and Llama configs parsed with HF's defaults, errors that name the file and the
// field, and configs written back and read again.
#include <catch2/catch.hpp>

#include <cstdio>

#include "models/causal_lm.hpp"
#include "models/hf/config.hpp"
#include "models/hf/testing.hpp"
#include "models/llama.hpp"

using namespace troupe;
using namespace troupe::models::hf;
using namespace troupe::models::hf::testing;
using Catch::Contains;
using kind = troupe::models::rope_scaling::kind;

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

// Llama 3.x checkpoints: rope_scaling of the types HF's modeling_rope_utils.py implements for Llama
// (but yarn and longrope), under "rope_type" or the older "type", and biases on the MLP.
TEST_CASE("A Llama config reads rope_scaling and mlp_bias as HF does", "[cpu]") {
  auto parse = [](const std::string& text) {
    auto c = parse_config(text, "config.json");
    INFO((c ? std::string() : c.error_message()));
    REQUIRE(c.has_value());
    return std::get<llama_config>(*c);
  };
  // Llama 3.1's config.
  const llama_config l31 = parse(llama_with("rope_scaling", R"({"factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
      "rope_type": "llama3"})"));
  CHECK(l31.rope_scaling.type == kind::llama3);
  CHECK(l31.rope_scaling.factor == 8.0);
  CHECK(l31.rope_scaling.low_freq_factor == 1.0);
  CHECK(l31.rope_scaling.high_freq_factor == 4.0);
  CHECK(l31.rope_scaling.original_max_position == 8192);
  const auto m31 = models::to_llama_config(l31);
  CHECK(m31.rope_scale == l31.rope_scaling);
  CHECK(m31.max_seq == 128);  // max_position_embeddings

  const llama_config lin = parse(llama_with("rope_scaling", R"({"type": "linear", "factor": 2})"));
  CHECK(lin.rope_scaling.type == kind::linear);
  CHECK(lin.rope_scaling.factor == 2.0);
  CHECK(parse(llama_with("rope_scaling", R"({"rope_type": "linear", "type": "linear",
      "factor": 2.0})"))
            .rope_scaling == lin.rope_scaling);

  // Dynamic: HF's threshold is max_position_embeddings whatever rope_scaling's
  // original_max_position_embeddings says; the model is planned for factor times it.
  const llama_config dyn = parse(llama_with("rope_scaling", R"({"rope_type": "dynamic",
      "factor": 2.5, "original_max_position_embeddings": 64})"));
  CHECK(dyn.rope_scaling.type == kind::dynamic);
  CHECK(dyn.rope_scaling.factor == 2.5);
  CHECK(dyn.rope_scaling.original_max_position == 64);
  const auto mdyn = models::to_llama_config(dyn);
  CHECK(mdyn.rope_scale.original_max_position == 128);
  CHECK(mdyn.max_seq == 320);

  CHECK(parse(llama_with("rope_scaling", R"({"rope_type": "default"})")).rope_scaling.type ==
        kind::none);
  const llama_config biased = parse(llama_with("mlp_bias", "true"));
  CHECK(biased.mlp_bias);
  CHECK(models::to_llama_config(biased).mlp_bias);
  CHECK(parse(llama_with("rope_scaling", R"({"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
      "attention_factor": 1.0})"))
            .rope_scaling == l31.rope_scaling);
}

TEST_CASE("Bad rope_scaling values are refused naming the key", "[cpu][faults]") {
  auto refused = [](const char* what, std::string message) {
    std::printf("faults: config.json %s -> refused: %s\n", what, message.c_str());
    return message;
  };
  auto with = [](const std::string& scaling) { return llama_with("rope_scaling", scaling); };
  const std::string llama3_keys = R"("low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192)";
  CHECK_THAT(
      refused("rope_scaling yarn", parse_error(with(R"({"rope_type": "yarn", "factor": 4.0})"))),
      Contains("field 'rope_scaling'") && Contains("'yarn'") && Contains("not supported"));
  CHECK_THAT(parse_error(with(R"({"type": "longrope", "factor": 4.0})")),
             Contains("field 'rope_scaling'") && Contains("'longrope'"));
  CHECK_THAT(parse_error(with("[1]")), Contains("field 'rope_scaling' must be an object or null"));
  CHECK_THAT(parse_error(with(R"({"factor": 2.0})")),
             Contains("field 'rope_scaling' has no 'rope_type'"));
  CHECK_THAT(parse_error(with(R"({"rope_type": "linear", "type": "dynamic", "factor": 2.0})")),
             Contains("field 'rope_scaling.type' is 'dynamic'") && Contains("must agree"));
  CHECK_THAT(
      refused("rope_scaling without factor", parse_error(with(R"({"rope_type": "linear"})"))),
      Contains("field 'rope_scaling.factor' is missing"));
  CHECK_THAT(refused("rope_scaling factor 0",
                     parse_error(with(R"({"rope_type": "dynamic", "factor": 0})"))),
             Contains("field 'rope_scaling.factor' must be positive"));
  CHECK_THAT(parse_error(with(R"({"rope_type": "linear", "factor": "2"})")),
             Contains("field 'rope_scaling.factor' must be a number"));
  CHECK_THAT(parse_error(with(R"({"rope_type": "llama3", "factor": 8.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})")),
             Contains("field 'rope_scaling.low_freq_factor' is missing"));
  CHECK_THAT(parse_error(with(R"({"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0})")),
             Contains("field 'rope_scaling.original_max_position_embeddings' is missing"));
  CHECK_THAT(
      refused("rope_scaling low >= high", parse_error(with(R"({"rope_type": "llama3", "factor": 8.0,
      "low_freq_factor": 4.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})"))),
      Contains("field 'rope_scaling.high_freq_factor' (4.0) must be greater than "
               "rope_scaling.low_freq_factor (4.0)"));
  CHECK_THAT(parse_error(with(R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192.5})")),
             Contains("field 'rope_scaling.original_max_position_embeddings' must be an integer"));
  CHECK_THAT(parse_error(with(R"({"rope_type": "dynamic", "factor": 2.0,
      "original_max_position_embeddings": 0})")),
             Contains("field 'rope_scaling.original_max_position_embeddings' must be positive"));
  CHECK_THAT(
      parse_error(with(R"({"rope_type": "llama3", "factor": 8.0, )" + llama3_keys +
                       R"(, "attention_factor": 2.0})")),
      Contains("field 'rope_scaling.attention_factor' is 2.0") && Contains("only 1 is accepted"));
  // head_dim 2: dynamic's exponent head_dim / (head_dim - 2) has no value.
  CHECK_THAT(
      parse_error(replace_first(with(R"({"rope_type": "dynamic", "factor": 2.0})"),
                                "\"num_attention_heads\": 8", "\"num_attention_heads\": 32")),
      Contains("field 'rope_scaling' is dynamic") && Contains("head_dim > 2"));
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
  CHECK_THAT(parse_error(llama_with("mlp_bias", "1")),
             Contains("field 'mlp_bias' must be true or false"));
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

  // rope_scaling and mlp_bias are written with their values: a save reads back the same, the
  // old "type" key kept beside rope_type where the source had it.
  for (const char* scaling :
       {R"({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})",
        R"({"type": "linear", "factor": 2.0})",
        R"({"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 64})",
        R"({"rope_type": "dynamic", "factor": 3.0})", "null"}) {
    INFO("rope_scaling " << scaling);
    auto s = parse_config(llama_with("rope_scaling", scaling), "config.json");
    REQUIRE(s.has_value());
    std::get<llama_config>(*s).mlp_bias = true;
    REQUIRE(write_config(dir.path(), *s).has_value());
    auto sb = read_config(dir.path());
    REQUIRE(sb.has_value());
    const auto& want = std::get<llama_config>(*s);
    const auto& got = std::get<llama_config>(*sb);
    CHECK(got.rope_scaling == want.rope_scaling);
    CHECK(got.mlp_bias);
    const bool old_key_written =
        read_bytes(dir / "config.json").find("\"type\": \"linear\"") != std::string::npos;
    const bool old_key_read = std::string(scaling).find("\"type\"") != std::string::npos;
    CHECK(old_key_written == old_key_read);
  }
  // Built in code (no source object): the keys of the type.
  llama_config built = std::get<llama_config>(*l);
  built.source_json = "";
  built.rope_scaling = {.type = kind::linear, .factor = 4.0};
  REQUIRE(write_config(dir.path(), built).has_value());
  auto bb = read_config(dir.path());
  REQUIRE(bb.has_value());
  CHECK(std::get<llama_config>(*bb).rope_scaling == built.rope_scaling);
  CHECK_FALSE(std::get<llama_config>(*bb).mlp_bias);

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
