// Parsing and writing HF config.json for GPT-2 and Llama (see config.hpp).
#include "models/hf/config.hpp"

#include <optional>

#include <nlohmann/json.hpp>

#include "models/hf/bounded_json.hpp"
#include "models/hf/file_io.hpp"

namespace troupe::models::hf {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

// Reads typed fields of one config object; every error names the file and the field.
class field_reader {
 public:
  // prefix: the dotted path of a nested object in messages ("rope_scaling.").
  field_reader(const json& j, std::string origin, std::string prefix = "")
      : j_(j), origin_(std::move(origin)), prefix_(std::move(prefix)) {}
  const std::string& origin() const { return origin_; }

  bool present(const char* key) const { return j_.contains(key) && !j_[key].is_null(); }

  std::int64_t integer(const char* key, std::optional<std::int64_t> def = std::nullopt) const {
    if (!present(key)) return required(key, def);
    const json& v = j_[key];
    if (!v.is_number_integer()) wrong_type(key, "an integer", v);
    return v.get<std::int64_t>();
  }
  std::int64_t positive(const char* key, std::optional<std::int64_t> def = std::nullopt) const {
    std::int64_t v = integer(key, def);
    if (v <= 0) bad(key, "must be positive, got " + std::to_string(v));
    return v;
  }
  double number(const char* key, std::optional<double> def = std::nullopt) const {
    if (!present(key)) return required(key, def);
    const json& v = j_[key];
    if (!v.is_number()) wrong_type(key, "a number", v);
    return v.get<double>();
  }
  double positive_number(const char* key, std::optional<double> def = std::nullopt) const {
    double v = number(key, def);
    if (!(v > 0)) bad(key, "must be positive, got " + j_.value(key, json(v)).dump());
    return v;
  }
  bool boolean(const char* key, bool def) const {
    if (!present(key)) return def;
    const json& v = j_[key];
    if (!v.is_boolean()) wrong_type(key, "true or false", v);
    return v.get<bool>();
  }
  std::string string(const char* key, const char* def) const {
    if (!present(key)) return def;
    const json& v = j_[key];
    if (!v.is_string()) wrong_type(key, "a string", v);
    return v.get<std::string>();
  }

  [[noreturn]] void bad(const char* key, const std::string& what) const {
    fail(origin_, ": field '", prefix_, key, "' ", what);
  }

 private:
  template <class T>
  T required(const char* key, std::optional<T> def) const {
    if (!def) fail(origin_, ": field '", prefix_, key, "' is missing");
    return *def;
  }
  [[noreturn]] void wrong_type(const char* key, const char* want, const json& v) const {
    bad(key, std::string("must be ") + want + ", got " + v.dump());
  }

  const json& j_;
  std::string origin_;
  std::string prefix_;
};

gpt2_config parse_gpt2(const json& j, const field_reader& r) {
  gpt2_config c;
  c.vocab_size = r.positive("vocab_size");
  c.n_positions = r.positive("n_positions");
  c.n_embd = r.positive("n_embd");
  c.n_layer = r.positive("n_layer");
  c.n_head = r.positive("n_head");
  c.layer_norm_epsilon = r.positive_number("layer_norm_epsilon", 1e-5);
  c.activation_function = r.string("activation_function", "gelu_new");
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", true);
  if (c.activation_function != "gelu_new")
    r.bad("activation_function", "is '" + c.activation_function + "'; only gelu_new is supported");
  if (c.n_embd % c.n_head != 0)
    r.bad("n_embd", "(" + std::to_string(c.n_embd) + ") must be a multiple of n_head (" +
                        std::to_string(c.n_head) + ")");
  if (r.present("n_inner") && r.integer("n_inner") != c.n_inner())
    r.bad("n_inner", "must be null or 4 * n_embd (" + std::to_string(c.n_inner()) + ")");
  if (!c.tie_word_embeddings) r.bad("tie_word_embeddings", "is false; GPT-2 needs a tied head");
  if (!r.boolean("scale_attn_weights", true))
    r.bad("scale_attn_weights", "is false, which is not supported");
  if (r.boolean("scale_attn_by_inverse_layer_idx", false))
    r.bad("scale_attn_by_inverse_layer_idx", "is true, which is not supported");
  c.source_json = j.dump();
  return c;
}

// HF's rope_scaling object (transformers' modeling_rope_utils.py and its validation): the keys
// each supported type needs, values in range, and the types troupe does not implement refused.
models::rope_scaling parse_rope_scaling(const json& j, const field_reader& r) {
  using kind = models::rope_scaling::kind;
  models::rope_scaling s;
  if (!r.present("rope_scaling")) return s;
  const json& o = j["rope_scaling"];
  if (!o.is_object()) r.bad("rope_scaling", "must be an object or null, got " + o.dump());
  field_reader f(o, r.origin(), "rope_scaling.");
  const std::string rope_type = f.string("rope_type", "");
  const std::string old_type = f.string("type", "");  // the key before transformers 4.43
  if (!rope_type.empty() && !old_type.empty() && rope_type != old_type)
    f.bad("type", "is '" + old_type + "' but rope_scaling.rope_type is '" + rope_type +
                      "'; they must agree");
  const std::string type = rope_type.empty() ? old_type : rope_type;
  if (type.empty()) r.bad("rope_scaling", "has no 'rope_type' (or 'type'): " + o.dump());
  if (type == "default") return s;
  if (type == "linear")
    s.type = kind::linear;
  else if (type == "dynamic")
    s.type = kind::dynamic;
  else if (type == "llama3")
    s.type = kind::llama3;
  else
    r.bad("rope_scaling", "has rope_type '" + type +
                              "', which is not supported (supported: default, linear, dynamic, "
                              "llama3)");
  s.factor = f.positive_number("factor");
  if (s.type == kind::llama3) {
    s.low_freq_factor = f.positive_number("low_freq_factor");
    s.high_freq_factor = f.positive_number("high_freq_factor");
    if (!(s.high_freq_factor > s.low_freq_factor))
      f.bad("high_freq_factor", "(" + o["high_freq_factor"].dump() +
                                    ") must be greater than rope_scaling.low_freq_factor (" +
                                    o["low_freq_factor"].dump() + ")");
    s.original_max_position = f.positive("original_max_position_embeddings");
  } else if (s.type == kind::dynamic && f.present("original_max_position_embeddings")) {
    s.original_max_position = f.positive("original_max_position_embeddings");
  }
  // HF scales cos and sin by 1 for these types whatever the config says (only yarn and longrope
  // read attention_factor): another value would be silently ignored, so it is refused.
  if (f.present("attention_factor") && f.number("attention_factor") != 1.0)
    f.bad("attention_factor", "is " + o["attention_factor"].dump() +
                                  "; HF applies no attention factor with rope_type '" + type +
                                  "' (it ignores the field), so only 1 is accepted");
  return s;
}

llama_config parse_llama(const json& j, const field_reader& r) {
  llama_config c;
  c.vocab_size = r.positive("vocab_size");
  c.hidden_size = r.positive("hidden_size");
  c.intermediate_size = r.positive("intermediate_size");
  c.num_hidden_layers = r.positive("num_hidden_layers");
  c.num_attention_heads = r.positive("num_attention_heads");
  c.num_key_value_heads = r.positive("num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = r.positive("max_position_embeddings");
  c.rms_norm_eps = r.positive_number("rms_norm_eps");
  c.rope_theta = r.positive_number("rope_theta", 10000.0);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  c.attention_bias = r.boolean("attention_bias", false);
  c.mlp_bias = r.boolean("mlp_bias", false);
  c.hidden_act = r.string("hidden_act", "silu");
  if (c.hidden_act != "silu")
    r.bad("hidden_act", "is '" + c.hidden_act + "'; only silu is supported");
  c.rope_scaling = parse_rope_scaling(j, r);
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.bad("num_key_value_heads", "(" + std::to_string(c.num_key_value_heads) +
                                     ") must divide num_attention_heads (" +
                                     std::to_string(c.num_attention_heads) + ")");
  if (!r.present("head_dim") && c.hidden_size % c.num_attention_heads != 0)
    r.bad("hidden_size", "(" + std::to_string(c.hidden_size) +
                             ") must be a multiple of num_attention_heads when head_dim is absent");
  c.head_dim = r.positive("head_dim", c.hidden_size / c.num_attention_heads);
  if (c.head_dim % 2 != 0) r.bad("head_dim", "must be even for RoPE");
  if (c.rope_scaling.type == models::rope_scaling::kind::dynamic && c.head_dim <= 2)
    r.bad("rope_scaling",
          "is dynamic, whose exponent head_dim / (head_dim - 2) needs head_dim > 2 "
          "(head_dim is " +
              std::to_string(c.head_dim) + ")");
  c.source_json = j.dump();
  return c;
}

moe_config parse_moe(const json& j, const field_reader& r, const std::string& type) {
  moe_config c;
  c.model_type = type;
  const bool qwen = c.qwen2_moe();
  c.vocab_size = r.positive("vocab_size");
  c.hidden_size = r.positive("hidden_size");
  c.intermediate_size = r.positive("intermediate_size");
  c.num_hidden_layers = r.positive("num_hidden_layers");
  c.num_attention_heads = r.positive("num_attention_heads");
  c.num_key_value_heads = r.positive("num_key_value_heads", c.num_attention_heads);
  c.max_position_embeddings = r.positive("max_position_embeddings");
  c.rms_norm_eps = r.positive_number("rms_norm_eps", qwen ? 1e-6 : 1e-5);
  c.rope_theta = r.positive_number("rope_theta", qwen ? 10000.0 : 1e6);
  c.tie_word_embeddings = r.boolean("tie_word_embeddings", false);
  c.num_experts = r.positive(qwen ? "num_experts" : "num_local_experts", qwen ? 60 : 8);
  c.num_experts_per_tok = r.positive("num_experts_per_tok", qwen ? 4 : 2);
  c.router_aux_loss_coef = r.number("router_aux_loss_coef", 0.001);
  c.output_router_logits = r.boolean("output_router_logits", false);
  c.hidden_act = r.string("hidden_act", "silu");
  if (c.hidden_act != "silu")
    r.bad("hidden_act", "is '" + c.hidden_act + "'; only silu is supported");
  if (c.num_experts_per_tok > c.num_experts)
    r.bad("num_experts_per_tok", "(" + std::to_string(c.num_experts_per_tok) +
                                     ") must be at most the number of experts (" +
                                     std::to_string(c.num_experts) + ")");
  if (c.router_aux_loss_coef < 0) r.bad("router_aux_loss_coef", "must be >= 0");
  if (c.num_attention_heads % c.num_key_value_heads != 0)
    r.bad("num_key_value_heads", "(" + std::to_string(c.num_key_value_heads) +
                                     ") must divide num_attention_heads (" +
                                     std::to_string(c.num_attention_heads) + ")");
  if (c.hidden_size % c.num_attention_heads != 0 ||
      (c.hidden_size / c.num_attention_heads) % 2 != 0)
    r.bad("hidden_size", "(" + std::to_string(c.hidden_size) +
                             ") must be num_attention_heads times an even head size");
  if (r.present("head_dim") && r.integer("head_dim") != c.hidden_size / c.num_attention_heads)
    r.bad("head_dim", "must be hidden_size / num_attention_heads, as " + type + " computes it");
  if (r.present("rope_scaling"))
    r.bad("rope_scaling", "is set; " + type + " models are supported without RoPE scaling");
  if (qwen) {
    c.moe_intermediate_size = r.positive("moe_intermediate_size");
    c.shared_expert_intermediate_size = r.positive("shared_expert_intermediate_size");
    c.norm_topk_prob = r.boolean("norm_topk_prob", false);
    if (r.boolean("use_sliding_window", false))
      r.bad("use_sliding_window", "is true; sliding-window attention is not supported");
    if (r.integer("decoder_sparse_step", 1) != 1)
      r.bad("decoder_sparse_step",
            "must be 1 (every layer sparse); dense layers between sparse "
            "ones are not supported");
    if (r.present("mlp_only_layers") &&
        !(j["mlp_only_layers"].is_array() && j["mlp_only_layers"].empty()))
      r.bad("mlp_only_layers",
            "must be empty; dense layers are not supported, got " + j["mlp_only_layers"].dump());
  } else {
    if (r.number("router_jitter_noise", 0.0) != 0.0)
      r.bad("router_jitter_noise",
            "must be 0; training-time jitter of the router's input is not "
            "supported");
    if (r.present("sliding_window") && r.positive("sliding_window") < c.max_position_embeddings)
      r.bad("sliding_window", "(" + j["sliding_window"].dump() +
                                  ") is shorter than max_position_embeddings; sliding-window "
                                  "attention is not supported");
  }
  c.source_json = j.dump();
  return c;
}

// The rope_scaling object written for `s`: the source's object (keeping keys troupe does not
// read) with the values of `s`, "type" only where the source had it; null without scaling.
json rope_scaling_json(const models::rope_scaling& s, const json& source) {
  using kind = models::rope_scaling::kind;
  if (s.type == kind::none) return nullptr;
  json o = source.is_object() ? source : json::object();
  const bool old_key = o.contains("type");
  for (const char* k : {"rope_type", "type", "factor", "low_freq_factor", "high_freq_factor",
                        "original_max_position_embeddings"})
    o.erase(k);
  const std::string type(models::rope_type_name(s.type));
  o["rope_type"] = type;
  if (old_key) o["type"] = type;
  o["factor"] = s.factor;
  if (s.type == kind::llama3) {
    o["low_freq_factor"] = s.low_freq_factor;
    o["high_freq_factor"] = s.high_freq_factor;
  }
  if (s.original_max_position > 0 && s.type != kind::linear)
    o["original_max_position_embeddings"] = s.original_max_position;
  return o;
}

std::string_view torch_dtype_name(dtype t) {
  switch (t) {
    case dtype::f64:
      return "float64";
    case dtype::bf16:
      return "bfloat16";
    case dtype::f16:
      return "float16";
    default:
      return "float32";
  }
}

json source_object(const std::string& source) {
  if (source.empty()) return json::object();
  json j = json::parse(source, nullptr, false);
  return j.is_object() ? j : json::object();
}

}  // namespace

expected<model_config> parse_config(std::string_view text, std::string_view origin) {
  return as_expected([&]() -> model_config {
    const std::string where = "config '" + std::string(origin) + "'";
    const json j = parse_bounded_json<json>(text, config_json_bounds, where);
    if (!j.is_object()) fail(where, ": not a JSON object");
    field_reader r(j, where);
    const std::string type = r.string("model_type", "");
    if (type.empty()) fail(where, ": field 'model_type' is missing");
    if (type == "gpt2") return parse_gpt2(j, r);
    if (type == "llama") return parse_llama(j, r);
    if (type == "mixtral" || type == "qwen2_moe") return parse_moe(j, r, type);
    r.bad("model_type", "is '" + type + "'; supported: gpt2, llama, mixtral, qwen2_moe");
  });
}

expected<model_config> read_config(const fs::path& path) {
  fs::path file = fs::is_directory(path) ? path / "config.json" : path;
  std::string text;
  try {
    text = read_bounded_text(file, config_json_bounds);
  } catch (const troupe::error& e) {
    return expected<model_config>::failure(e.what() + interrupted_save_note(path));
  }
  return parse_config(text, file.string());
}

std::string config_json(const model_config& cfg, dtype weights) {
  json j;
  if (const auto* g = std::get_if<gpt2_config>(&cfg)) {
    j = source_object(g->source_json);
    j["model_type"] = "gpt2";
    j["architectures"] = {"GPT2LMHeadModel"};
    j["vocab_size"] = g->vocab_size;
    j["n_positions"] = g->n_positions;
    j["n_ctx"] = g->n_positions;
    j["n_embd"] = g->n_embd;
    j["n_layer"] = g->n_layer;
    j["n_head"] = g->n_head;
    j["n_inner"] = nullptr;
    j["layer_norm_epsilon"] = g->layer_norm_epsilon;
    j["activation_function"] = g->activation_function;
    j["tie_word_embeddings"] = g->tie_word_embeddings;
  } else if (const auto* m = std::get_if<moe_config>(&cfg)) {
    j = source_object(m->source_json);
    const bool qwen = m->qwen2_moe();
    j["model_type"] = m->model_type;
    j["architectures"] = {qwen ? "Qwen2MoeForCausalLM" : "MixtralForCausalLM"};
    j["vocab_size"] = m->vocab_size;
    j["hidden_size"] = m->hidden_size;
    j["intermediate_size"] = m->intermediate_size;
    j["num_hidden_layers"] = m->num_hidden_layers;
    j["num_attention_heads"] = m->num_attention_heads;
    j["num_key_value_heads"] = m->num_key_value_heads;
    j["max_position_embeddings"] = m->max_position_embeddings;
    j["rms_norm_eps"] = m->rms_norm_eps;
    j["rope_theta"] = m->rope_theta;
    j["tie_word_embeddings"] = m->tie_word_embeddings;
    j[qwen ? "num_experts" : "num_local_experts"] = m->num_experts;
    j["num_experts_per_tok"] = m->num_experts_per_tok;
    j["router_aux_loss_coef"] = m->router_aux_loss_coef;
    j["output_router_logits"] = m->output_router_logits;
    j["hidden_act"] = m->hidden_act;
    if (qwen) {
      j["moe_intermediate_size"] = m->moe_intermediate_size;
      j["shared_expert_intermediate_size"] = m->shared_expert_intermediate_size;
      j["norm_topk_prob"] = m->norm_topk_prob;
      j["decoder_sparse_step"] = 1;
      j["mlp_only_layers"] = json::array();
    }
  } else {
    const auto& l = std::get<llama_config>(cfg);
    j = source_object(l.source_json);
    j["model_type"] = "llama";
    j["architectures"] = {"LlamaForCausalLM"};
    j["vocab_size"] = l.vocab_size;
    j["hidden_size"] = l.hidden_size;
    j["intermediate_size"] = l.intermediate_size;
    j["num_hidden_layers"] = l.num_hidden_layers;
    j["num_attention_heads"] = l.num_attention_heads;
    j["num_key_value_heads"] = l.num_key_value_heads;
    j["head_dim"] = l.head_dim;
    j["max_position_embeddings"] = l.max_position_embeddings;
    j["rms_norm_eps"] = l.rms_norm_eps;
    j["rope_theta"] = l.rope_theta;
    j["rope_scaling"] = rope_scaling_json(l.rope_scaling, j.value("rope_scaling", json()));
    j["tie_word_embeddings"] = l.tie_word_embeddings;
    j["attention_bias"] = l.attention_bias;
    j["mlp_bias"] = l.mlp_bias;
    j["hidden_act"] = l.hidden_act;
  }
  j["torch_dtype"] = torch_dtype_name(weights);
  return j.dump(2) + "\n";
}

expected<fs::path> write_config(const fs::path& folder, const model_config& cfg, dtype weights) {
  return as_expected([&] {
    fs::path file = folder / "config.json";
    write_text_file_atomically(file, config_json(cfg, weights));
    return file;
  });
}

gpt_config to_gpt_config(const gpt2_config& c) {
  return {.vocab = c.vocab_size,
          .max_seq = c.n_positions,
          .dim = c.n_embd,
          .n_layer = c.n_layer,
          .n_head = c.n_head,
          .ln_eps = c.layer_norm_epsilon};
}

}  // namespace troupe::models::hf
