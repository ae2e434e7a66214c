// config: the HF `config.json` of a GPT-2, Llama, Mixtral or Qwen2-MoE model, parsed into plain
// structs and written back.
//
// Parsing is strict where the numbers shape the model and follows HF's defaults elsewhere: the
// fields that fix a tensor shape are required; a field of the wrong JSON type, a value out of
// range, or a feature this runtime does not implement (another activation, a rope_scaling type
// other than linear, dynamic and llama3, ...) is an error naming the file and the field. The
// original JSON object is kept, so that writing the config back preserves the fields troupe does
// not read (token ids, torch_dtype, ...).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <variant>

#include "memory/error.hpp"
#include "models/gpt.hpp"
#include "models/layers/rope_scaling.hpp"
#include "tensor/dtype.hpp"

namespace troupe::models::hf {

// GPT2LMHeadModel (model_type "gpt2").
struct gpt2_config {
  std::int64_t vocab_size = 50257;
  std::int64_t n_positions = 1024;
  std::int64_t n_embd = 768;
  std::int64_t n_layer = 12;
  std::int64_t n_head = 12;
  double layer_norm_epsilon = 1e-5;
  std::string activation_function = "gelu_new";  // the only one supported
  bool tie_word_embeddings = true;               // only tied heads are supported
  std::string source_json = "";                  // the parsed object ("" when built in code)

  std::int64_t n_inner() const { return 4 * n_embd; }
};

// LlamaForCausalLM (model_type "llama").
struct llama_config {
  std::int64_t vocab_size = 32000;
  std::int64_t hidden_size = 4096;
  std::int64_t intermediate_size = 11008;
  std::int64_t num_hidden_layers = 32;
  std::int64_t num_attention_heads = 32;
  std::int64_t num_key_value_heads = 32;
  std::int64_t head_dim = 128;  // hidden_size / num_attention_heads unless given
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool attention_bias = false;
  bool mlp_bias = false;
  // rope_scaling as config.json gives it (none: null or rope_type "default"); "type" is read as
  // rope_type, as HF does. For dynamic, original_max_position is the optional
  // original_max_position_embeddings (0: absent), which HF does not use: its threshold is
  // max_position_embeddings (to_llama_config, models/causal_lm.hpp).
  models::rope_scaling rope_scaling{};
  std::string hidden_act = "silu";  // the only one supported
  std::string source_json = "";
};

// MixtralForCausalLM (model_type "mixtral") and Qwen2MoeForCausalLM ("qwen2_moe"), one struct:
// the fields of both, named as config.json names them (Mixtral's num_local_experts is num_experts
// here; its experts' width is its intermediate_size, Qwen2-MoE's moe_intermediate_size). Refused
// when read: router_jitter_noise != 0, a sliding window shorter than max_position_embeddings
// (Mixtral) or use_sliding_window (Qwen2-MoE), decoder_sparse_step != 1 and a non-empty
// mlp_only_layers (Qwen2-MoE's dense layers), rope_scaling, another hidden_act.
struct moe_config {
  std::string model_type = "mixtral";  // or "qwen2_moe"
  std::int64_t vocab_size = 32000;
  std::int64_t hidden_size = 4096;
  std::int64_t intermediate_size = 14336;  // Mixtral: each expert's; Qwen2-MoE: dense layers'
  std::int64_t moe_intermediate_size = 0;  // Qwen2-MoE: each expert's
  std::int64_t shared_expert_intermediate_size = 0;  // Qwen2-MoE
  std::int64_t num_hidden_layers = 32;
  std::int64_t num_attention_heads = 32;
  std::int64_t num_key_value_heads = 8;
  std::int64_t max_position_embeddings = 4096;
  double rms_norm_eps = 1e-5;
  double rope_theta = 1e6;
  bool tie_word_embeddings = false;
  std::int64_t num_experts = 8;  // Mixtral's num_local_experts
  std::int64_t num_experts_per_tok = 2;
  bool norm_topk_prob = true;  // Qwen2-MoE's field; Mixtral always renormalises
  double router_aux_loss_coef = 0.001;
  bool output_router_logits = false;  // HF adds the aux loss to the loss only when true
  // Not HF's and not written to config.json: the run's model.moe_capacity_factor (0: dropless).
  double capacity_factor = 0;
  std::string hidden_act = "silu";
  std::string source_json = "";

  bool qwen2_moe() const { return model_type == "qwen2_moe"; }
  std::int64_t expert_size() const {
    return qwen2_moe() ? moe_intermediate_size : intermediate_size;
  }
};

using model_config = std::variant<gpt2_config, llama_config, moe_config>;

// Parses config.json text; `origin` names the file in errors.
expected<model_config> parse_config(std::string_view text, std::string_view origin);
// Reads and parses a config.json file (or `<folder>/config.json` when given a folder).
expected<model_config> read_config(const std::filesystem::path& path);

// The JSON text of a config: the source object (if any) with troupe's fields written over it,
// plus model_type, architectures and torch_dtype (from `weights`: the dtype saved on disk).
std::string config_json(const model_config& cfg, dtype weights = dtype::f32);
// Writes `<folder>/config.json` atomically.
expected<std::filesystem::path> write_config(const std::filesystem::path& folder,
                                             const model_config& cfg, dtype weights = dtype::f32);

// The model's own config (models/gpt.hpp) of an HF GPT-2 config.
gpt_config to_gpt_config(const gpt2_config& c);

}  // namespace troupe::models::hf
