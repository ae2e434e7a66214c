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
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "models/block_use.hpp"
#include "models/kv_cache.hpp"
#include "models/layers/attention.hpp"
#include "models/layers/cross_entropy.hpp"
#include "models/layers/embedding.hpp"
#include "models/layers/linear.hpp"
#include "models/layers/residual.hpp"
#include "models/layers/rmsnorm.hpp"
#include "models/layers/slots.hpp"
#include "models/layers/swiglu_mlp.hpp"

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
struct llama_block {
  rmsnorm input_layernorm, post_attention_layernorm;
  attention self_attn;
  swiglu_mlp mlp;
  residual_buffers buf;  // activations and backward scratch [B, T, C]

  explicit llama_block(const llama_config& c);
  // recompute: the block's activations live in a recomputed scope (see slots.hpp), shared with
  // the other recomputed blocks; call recompute(x) before backward.
  void declare(slot_list& s, std::string_view name, batch_dims b, bool recompute = false);
  void forward(const tensor& x, const tensor& y);
  // forward again from the same x without writing y: restores what backward reads.
  void recompute(const tensor& x);
  void backward(const tensor& dy, const tensor& dx);  // dx may alias dy
  // forward for new positions start.. with the attention over a kv cache (models/kv_cache.hpp).
  void forward_step(const tensor& x, const tensor& y, const kv_layer& cache, std::int64_t start);

 private:
  void run(const tensor& x, const tensor& y, const kv_layer* cache, std::int64_t start);
};

class llama {
 public:
  llama(const llama_config& cfg, batch_dims dims, dtype t = dtype::f32, device dev = device::cpu());
  llama(const llama&) = delete;
  llama& operator=(const llama&) = delete;

  const llama_config& config() const { return cfg_; }  // with n_kv_head and head_dim resolved
  const slot_list& slots() const { return slots_; }
  layer_memory& memory() { return mem_; }

  // HF's initialisation (LlamaPreTrainedModel._init_weights): N(0, init_std) for embeddings and
  // projections, zero biases, unit norm weights; deterministic in the seed.
  void init_weights(std::uint64_t seed);
  // The values init_weights(seed) gives, parameter after parameter (as gpt::init_values).
  void init_values(std::uint64_t seed, const init_sink& each) const;

  // ids, targets: i32 [B, T] on the model's device (T <= the planned seq, B <= the planned batch).
  // Returns the mean loss over targets that are not -100; keeps what backward needs.
  double forward(const tensor& ids, const tensor& targets);
  // Logits of the last forward, [B*T, V] (overwritten by backward).
  tensor logits() const { return logits_cur_; }
  // Accumulates d(loss_scale * loss)/d(params) into the gradients (zero them first with
  // memory().zero_grads()); once per forward. With config().recompute, each block but the last
  // runs its forward again first.
  void backward(double loss_scale = 1.0);
  // Called by backward as soon as block i's parameter gradients are final (i = n_layer - 1 down
  // to 0), e.g. to start reducing them while the rest of backward runs. Empty: not called.
  std::function<void(std::int64_t block)> on_block_grads;
  // Called around every use of block i's parameters in forward and backward (models/block_use.hpp),
  // e.g. to gather them just in time. Empty: not called.
  block_use_hook on_block_use;

  // Incremental decoding with a kv cache, as gpt's: begin_generation plans a cache for `batch`
  // sequences of up to `capacity` positions (0: max_seq); step_logits runs new tokens ids [B, t]
  // at the next positions and returns the logits of the last one, [B, V] (valid until the next
  // call). Steps reuse the training activations: run forward again before backward.
  void begin_generation(std::int64_t batch, std::int64_t capacity = 0);
  tensor step_logits(const tensor& ids);
  std::int64_t generated_length() const { return cache_ ? cache_->length() : 0; }

 private:
  // The head's weight and gradient: lm_head's, or embed_tokens' when tied.
  const tensor& head_weight() const;
  const tensor& head_grad() const;
  void check_ids(const tensor& ids, const char* what) const;

  llama_config cfg_;
  batch_dims dims_;
  embedding embed_tokens_;
  std::vector<llama_block> layers_;
  rmsnorm norm_;
  linear lm_head_;
  cross_entropy_loss loss_;
  std::vector<tensor> x_;     // residual stream: x_[i] is the input of layer i; [B, T, C]
  tensor norm_out_, logits_;  // activations
  tensor dx_a_, dx_b_;        // backward scratch [B, T, C]
  tensor logits_cur_, norm_cur_;
  std::int64_t b_ = 0, t_ = 0;
  slot_list slots_;
  layer_memory mem_;
  std::unique_ptr<kv_cache> cache_;
  dtype dtype_;
  device dev_;
};

}  // namespace troupe::models
