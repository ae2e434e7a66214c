#include "models/causal_lm.hpp"

#include <algorithm>
#include <string>

#include "models/families.hpp"
#include "models/gpt.hpp"
#include "models/llama.hpp"
#include "models/moe.hpp"

namespace troupe::models {

llama_config to_llama_config(const hf::llama_config& c) {
  llama_config m{.vocab = c.vocab_size,
                 .dim = c.hidden_size,
                 .n_layer = c.num_hidden_layers,
                 .n_head = c.num_attention_heads,
                 .n_kv_head = c.num_key_value_heads,
                 .head_dim = c.head_dim,
                 .hidden = c.intermediate_size,
                 .rms_eps = c.rms_norm_eps,
                 .rope_theta = c.rope_theta,
                 .max_seq = c.max_position_embeddings,
                 .tie_embeddings = c.tie_word_embeddings,
                 .attention_bias = c.attention_bias,
                 .mlp_bias = c.mlp_bias,
                 .rope_scale = c.rope_scaling};
  if (m.rope_scale.type == rope_scaling::kind::dynamic) {
    // HF grows theta past max_position_embeddings (its threshold, whatever rope_scaling's
    // original_max_position_embeddings says) and sets no length limit; troupe plans for
    // factor times it, the length the scaling is meant to reach.
    m.rope_scale.original_max_position = c.max_position_embeddings;
    m.max_seq = std::max(c.max_position_embeddings,
                         static_cast<std::int64_t>(c.rope_scaling.factor *
                                                   static_cast<double>(c.max_position_embeddings)));
  }
  return m;
}

std::string describe_load(const moe_load& l) {
  std::string s = "expert choices";
  for (auto n : l.selected) s.append(" ").append(std::to_string(n));
  s.append(" (of ").append(std::to_string(l.choices)).append("), dropped ");
  s.append(std::to_string(l.dropped));
  return s;
}

moe_config to_moe_config(const hf::moe_config& c) {
  return {.vocab = c.vocab_size,
          .dim = c.hidden_size,
          .n_layer = c.num_hidden_layers,
          .n_head = c.num_attention_heads,
          .n_kv_head = c.num_key_value_heads,
          .rms_eps = c.rms_norm_eps,
          .rope_theta = c.rope_theta,
          .max_seq = c.max_position_embeddings,
          .tie_embeddings = c.tie_word_embeddings,
          .qkv_bias = c.qwen2_moe(),
          .expert_hidden = c.expert_size(),
          .n_expert = static_cast<std::int32_t>(c.num_experts),
          .top_k = static_cast<std::int32_t>(c.num_experts_per_tok),
          .norm_topk_prob = c.qwen2_moe() ? c.norm_topk_prob : true,
          .shared_hidden = c.qwen2_moe() ? c.shared_expert_intermediate_size : 0,
          .capacity_factor = c.capacity_factor,
          .router_aux_loss_coef = c.router_aux_loss_coef,
          .aux_loss = c.output_router_logits};
}

std::unique_ptr<causal_lm> make_causal_lm(const hf::model_config& cfg, batch_dims dims, dtype t,
                                          device dev, const model_options& opts) {
  return with_family(cfg, [&](auto family, auto c) -> std::unique_ptr<causal_lm> {
    using F = typename decltype(family)::type;
    c.recompute = opts.recompute;
    return std::make_unique<causal_lm_of<typename F::model>>(c, dims, t, dev);
  });
}

expected<hf::model_config> named_model_config(std::string_view name, std::int64_t vocab) {
  auto gpt2 = [&](std::int64_t v, std::int64_t pos, std::int64_t dim, std::int64_t layers,
                  std::int64_t heads) {
    hf::gpt2_config c;
    c.vocab_size = vocab > 0 ? vocab : v;
    c.n_positions = pos;
    c.n_embd = dim;
    c.n_layer = layers;
    c.n_head = heads;
    return hf::model_config(c);
  };
  if (name == "gpt2-demo") return gpt2(256, 256, 128, 4, 4);
  if (name == "gpt2-small") return gpt2(50257, 1024, 768, 12, 12);
  if (name == "bench-small") return gpt2(8192, 256, 384, 6, 6);
  if (name == "llama-tiny") {
    hf::llama_config c;
    c.vocab_size = vocab > 0 ? vocab : 256;
    c.hidden_size = 128;
    c.intermediate_size = 352;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 32;
    c.max_position_embeddings = 256;
    c.rms_norm_eps = 1e-5;
    return hf::model_config(c);
  }
  if (name == "mixtral-tiny") {  // 4 layers x 128, 4 experts top-2, the aux loss in the loss
    hf::moe_config c;
    c.vocab_size = vocab > 0 ? vocab : 256;
    c.hidden_size = 128;
    c.intermediate_size = 176;
    c.num_hidden_layers = 4;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.max_position_embeddings = 256;
    c.num_experts = 4;
    c.num_experts_per_tok = 2;
    c.output_router_logits = true;
    c.router_aux_loss_coef = 0.01;
    return hf::model_config(c);
  }
  return expected<hf::model_config>::failure(
      "unknown model size '" + std::string(name) +
      "' (known: gpt2-demo, gpt2-small, bench-small, llama-tiny, mixtral-tiny)");
}

}  // namespace troupe::models
