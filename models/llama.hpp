// llama: a Llama language model (HF LlamaForCausalLM semantics) composed of the layers, with its
// memory planned before the first step.
//
//   x = embed_tokens[ids]
//   for each layer: r = x + self_attn(input_layernorm(x)); x = r + mlp(post_attention_layernorm(r))
//   logits = norm(x) @ lm_head^T  (lm_head is embed_tokens when tie_embeddings)
//   loss = mean cross-entropy(logits, targets)
//
// As in HF (transformers 4.38 to 4.44): RMSNorm y = w * x / sqrt(mean(x^2) + rms_eps); attention
// with separate q/k/v/o projections (bias only with attention_bias, on all four), grouped-query
// heads (n_kv_head), RoPE in the rotate-half convention with rope_theta (inverse frequencies and
// angles in f32 like HF) and HF's rope_scaling types linear, dynamic and llama3
// (models/layers/rope_scaling.hpp: which length dynamic scaling uses), scale 1/sqrt(head_dim); MLP
// down_proj(silu(gate_proj(x)) * up_proj(x)), with a bias on all three only with mlp_bias.
//
// Loss: HF's `labels=input_ids` shifts internally (mean over B x (T-1) positions); pass
// next_token_targets(ids) (models/targets.hpp) as targets for exactly that loss.
//
// Parameter names are HF's without the leading "model.": embed_tokens.weight,
// layers.{i}.input_layernorm.weight, layers.{i}.self_attn.{q,k,v,o}_proj.weight (and .bias with
// attention_bias), layers.{i}.post_attention_layernorm.weight,
// layers.{i}.mlp.{gate,up,down}_proj.weight (and .bias with mlp_bias), norm.weight and, untied
// only, lm_head.weight. Layouts are HF's ([out, in] for every projection), so checkpoints load
// without transposes.
//
// The embed -> layers -> head composition is the trunk's (models/trunk.hpp); this file holds
// Llama's parts (llama_block, llama_ends, llama_family) and the whole model (llama).
#pragma once

#include <cstdint>
#include <string_view>
#include <tuple>

#include "models/kv_cache.hpp"
#include "models/layers/attention.hpp"
#include "models/layers/cross_entropy.hpp"
#include "models/layers/embedding.hpp"
#include "models/layers/linear.hpp"
#include "models/layers/residual.hpp"
#include "models/layers/rmsnorm.hpp"
#include "models/layers/slots.hpp"
#include "models/layers/swiglu_mlp.hpp"
#include "models/pre_norm_block.hpp"
#include "models/trunk.hpp"

namespace troupe::models {

// The fields of HF's LlamaConfig that the model uses (config.json names in comments).
struct llama_config {
  std::int64_t vocab = 256;     // vocab_size
  std::int64_t dim = 64;        // hidden_size
  std::int64_t n_layer = 2;     // num_hidden_layers
  std::int64_t n_head = 4;      // num_attention_heads
  std::int64_t n_kv_head = 0;   // num_key_value_heads (0: n_head)
  std::int64_t head_dim = 0;    // dim / n_head in HF 4.38 (0: that)
  std::int64_t hidden = 0;      // intermediate_size (required)
  double rms_eps = 1e-6;        // rms_norm_eps
  double rope_theta = 10000.0;  // rope_theta
  // The longest sequence: max_position_embeddings (with dynamic rope_scaling, which exists to run
  // longer sequences, hf::to_llama_config makes it factor times that; see causal_lm.hpp).
  std::int64_t max_seq = 2048;
  bool tie_embeddings = false;  // tie_word_embeddings
  bool attention_bias = false;  // attention_bias
  bool mlp_bias = false;        // mlp_bias
  rope_scaling rope_scale{};    // rope_scaling (none: plain RoPE)
  double init_std = 0.02;       // initializer_range
  // Activation checkpointing per layer (not in HF's config): keep only each layer's input and
  // run its forward again right before its backward; all layers share one set of activation bytes.
  bool recompute = false;
  // Declare the slots only and bind no memory (as gpt_config::unbound).
  bool unbound = false;
};

// r = x + self_attn(input_layernorm(x)); y = r + mlp(post_attention_layernorm(r)).
struct llama_block : pre_norm_block<llama_block> {
  rmsnorm input_layernorm, post_attention_layernorm;
  attention self_attn;
  swiglu_mlp mlp;
  residual_buffers buf;  // activations and backward scratch [B, T, C]

  explicit llama_block(const llama_config& c);
  auto parts() { return std::tie(input_layernorm, self_attn, post_attention_layernorm, mlp); }
  static constexpr const char* part_names[4] = {"input_layernorm", "self_attn",
                                                "post_attention_layernorm", "mlp"};
  static constexpr const char* label = "llama_block";
};

// The two ends of Llama around its layers: embed_tokens in front; the final norm, the head
// (lm_head, or embed_tokens when tied) and the loss behind; their activations and backward scratch.
// The trunk (models/trunk.hpp) runs them around the layers. declare_front adds embed_tokens,
// declare_back norm, lm_head (untied only), norm_out, logits, loss and the scratch dx_a, dx_b.
struct llama_ends {
  explicit llama_ends(const llama_config& c);  // c resolved (llama_family::checked)
  void declare_front(slot_list& s, batch_dims d);
  void declare_back(slot_list& s, batch_dims d);
  // x0 = embed_tokens[ids]; ids i32 [B, t], x0 [B, t, C]. The positions go to RoPE in the
  // attention, not here.
  void embed(const tensor& ids, const tensor& positions, const tensor& x0);
  // norm, the head and the mean loss of x [B, T, C] (the last layer's output) on targets.
  double head(const tensor& x, const tensor& targets);
  // The head's backward: dx gets d(x) (views of the planned scratch; spare is the other one).
  void head_backward(double loss_scale, tensor& dx, tensor& spare);
  // embed_tokens' backward from d(x0) [B, T, C].
  void embed_backward(const tensor& dx0);
  // norm and the head on the last position of x [B, t, C]: logits [B, V] (decoding).
  tensor last_logits(const tensor& x);
  // The head's weight and gradient: lm_head's, or embed_tokens' when tied.
  const tensor& head_weight() const { return tied ? embed_tokens.weight : lm_head.weight; }
  const tensor& head_grad() const { return tied ? embed_tokens.dweight : lm_head.dweight; }

  std::int64_t dim, vocab;
  bool tied;
  embedding embed_tokens;
  rmsnorm norm;
  linear lm_head;
  cross_entropy_loss loss;
  tensor norm_out, logits;      // activations
  tensor dx_a, dx_b;            // backward scratch [B, T, C]
  tensor logits_cur, norm_cur;  // views of the last head()
};

class llama;

// Llama's parts for the trunk (models/trunk.hpp): layers "layers.<i>", the ends above.
struct llama_family {
  using config = llama_config;
  using block = llama_block;
  using ends = llama_ends;
  using model = llama;  // the whole model
  static constexpr const char* name = "llama";
  static constexpr const char* label = "Llama";  // for logs
  static constexpr const char* block_scope = "layers";
  // The checks of a config, n_kv_head and head_dim resolved.
  static llama_config checked(const llama_config& c);
  static const llama_config& block_config(const llama_config& c) { return c; }
  static const attention& attention_of(const llama_block& b) { return b.self_attn; }
};

extern template class trunk<llama_family>;

// The whole model: the trunk of Llama with every slot bound in one layer_memory. forward,
// backward, logits, the hooks on_block_grads / on_block_use and generation (begin_generation,
// step_logits) are the trunk's; config() has n_kv_head and head_dim resolved.
class llama : public trunk<llama_family> {
 public:
  llama(const llama_config& cfg, batch_dims dims, dtype t = dtype::f32, device dev = device::cpu());

  layer_memory& memory() { return mem_; }

  // HF's initialisation (LlamaPreTrainedModel._init_weights): N(0, init_std) for embeddings and
  // projections, zero biases, unit norm weights; deterministic in the seed.
  void init_weights(std::uint64_t seed);
  // The values init_weights(seed) gives, parameter after parameter (as gpt::init_values).
  void init_values(std::uint64_t seed, const init_sink& each) const;

 private:
  layer_memory mem_;
};

}  // namespace troupe::models
