// moe: a sparse mixture-of-experts language model with HF semantics: MixtralForCausalLM and
// Qwen2MoeForCausalLM (transformers 4.44), one family on the trunk (models/trunk.hpp).
//
//   x = embed_tokens[ids]
//   for each layer: r = x + self_attn(input_layernorm(x)); x = r + mlp(post_attention_layernorm(r))
//   logits = norm(x) @ lm_head^T  (lm_head is embed_tokens when tie_embeddings)
//   loss = mean cross-entropy(logits, targets) + router_aux_loss_coef * aux   (aux_loss on)
//
// Llama's block with its SwiGLU MLP replaced by a sparse MoE layer (models/layers/moe_ffn.hpp:
// the router, top-k routing, SwiGLU experts and, for Qwen2-MoE, the shared expert with its sigmoid
// gate). Attention, norms, RoPE and the ends are Llama's (Qwen2-MoE: q, k and v biases).
//
// aux is HF's load_balancing_loss_func over every layer's router of the forward (no attention
// mask): with M = n_layer * rows, f_e = (top-k choices of expert e over all layers) / M and
// P_e = (sum of p[., e] over all layers' rows) / M, aux = n_expert * sum_e f_e P_e. HF adds it only
// when the config's output_router_logits is true (aux_loss here), and so does troupe; its gradient
// reaches every router through p (f_e is piecewise constant). The ends compute it from the layers'
// statistics (moe_ends), so the trunk runs the family unchanged but for one connection made when
// it is built (moe_family::connect).
//
// Parameter names are Qwen2-MoE's without "model.": layers.{i}.mlp.gate.weight,
// layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight, layers.{i}.mlp.shared_expert.*,
// layers.{i}.mlp.shared_expert_gate.weight, and Llama's for the rest; the HF name map
// (models/hf/name_map.hpp) maps Mixtral's block_sparse_moe.gate and experts.{e}.w1 / w3 / w2 to
// them.
#pragma once

#include <cstdint>
#include <tuple>
#include <vector>

#include "models/layers/attention.hpp"
#include "models/layers/moe_ffn.hpp"
#include "models/layers/residual.hpp"
#include "models/layers/rmsnorm.hpp"
#include "models/llama.hpp"
#include "models/pre_norm_block.hpp"
#include "models/trunk.hpp"

namespace troupe::models {

// The fields of HF's MixtralConfig / Qwen2MoeConfig that the model uses.
struct moe_config {
  std::int64_t vocab = 256;     // vocab_size
  std::int64_t dim = 64;        // hidden_size
  std::int64_t n_layer = 2;     // num_hidden_layers
  std::int64_t n_head = 4;      // num_attention_heads
  std::int64_t n_kv_head = 0;   // num_key_value_heads (0: n_head)
  std::int64_t head_dim = 0;    // dim / n_head (0: that)
  double rms_eps = 1e-6;        // rms_norm_eps
  double rope_theta = 1e6;      // rope_theta
  std::int64_t max_seq = 2048;  // max_position_embeddings
  bool tie_embeddings = false;  // tie_word_embeddings
  bool qkv_bias = false;        // Qwen2-MoE: q_proj, k_proj, v_proj have biases (o_proj none)
  // The MoE layer.
  std::int64_t expert_hidden = 0;  // Mixtral: intermediate_size; Qwen2-MoE: moe_intermediate_size
  std::int32_t n_expert = 8;       // num_local_experts / num_experts
  std::int32_t top_k = 2;          // num_experts_per_tok
  bool norm_topk_prob = true;      // Mixtral: always; Qwen2-MoE: norm_topk_prob
  std::int64_t shared_hidden = 0;  // Qwen2-MoE: shared_expert_intermediate_size (0: none)
  double capacity_factor = 0;      // not in HF (dropless); > 0: each expert's capacity factor
  double router_aux_loss_coef = 0.001;  // router_aux_loss_coef
  bool aux_loss = false;                // output_router_logits: the loss includes the aux loss
  double init_std = 0.02;               // initializer_range
  bool recompute = false;               // as llama_config::recompute
  bool unbound = false;                 // as llama_config::unbound
  // Expert parallelism (models/layers/moe_dispatch.hpp): this rank holds experts
  // [ep_rank * n_expert / ep, (ep_rank + 1) * n_expert / ep) of every layer; the model's
  // set_expert_exchange gives the layers their group before the first forward.
  std::int32_t ep = 1;
  std::int32_t ep_rank = 0;
};

// r = x + self_attn(input_layernorm(x)); y = r + mlp(post_attention_layernorm(r)).
struct moe_block : pre_norm_block<moe_block> {
  rmsnorm input_layernorm, post_attention_layernorm;
  attention self_attn;
  moe_ffn mlp;
  residual_buffers buf;

  explicit moe_block(const moe_config& c);
  auto parts() { return std::tie(input_layernorm, self_attn, post_attention_layernorm, mlp); }
  static constexpr const char* part_names[4] = {"input_layernorm", "self_attn",
                                                "post_attention_layernorm", "mlp"};
  static constexpr const char* label = "moe_block";
};

// The load statistics of the last forward, summed over the layers.
struct moe_load {
  std::vector<std::int64_t> selected;  // per expert: top-k choices of it
  std::int64_t dropped = 0;            // choices over an expert's capacity
  std::int64_t choices = 0;            // all top-k choices (layers x rows x top_k)
  // Per local expert (experts first_expert, first_expert + 1, ...): the rows it served, from
  // every rank of its expert-parallel group (ep 1: the same as `selected` less the dropped).
  std::int32_t first_expert = 0;
  std::vector<std::int64_t> served;
};

// Llama's ends, with the aux loss added to the loss and its gradient handed to the layers.
struct moe_ends : llama_ends {
  explicit moe_ends(const moe_config& c);
  double head(const tensor& x, const tensor& targets);
  void head_backward(double loss_scale, tensor& dx, tensor& spare);

  double coef;
  bool with_aux;
  std::vector<moe_ffn*> layers;  // set by moe_family::connect
  double aux = 0;                // the last head()'s aux loss (computed whether added or not)
};

class moe;

struct moe_family {
  using config = moe_config;
  using block = moe_block;
  using ends = moe_ends;
  using model = moe;
  static constexpr const char* name = "moe";
  static constexpr const char* label = "MoE";
  static constexpr const char* block_scope = "layers";
  static moe_config checked(const moe_config& c);
  static const moe_config& block_config(const moe_config& c) { return c; }
  static const attention& attention_of(const moe_block& b) { return b.self_attn; }
  // Gives the ends every layer's MoE layer (the aux loss reads their statistics).
  static void connect(moe_ends& e, std::vector<moe_block>& blocks);
};

extern template class trunk<moe_family>;

// The whole model: the trunk of the MoE family with every slot bound in one layer_memory.
class moe : public trunk<moe_family> {
 public:
  moe(const moe_config& cfg, batch_dims dims, dtype t = dtype::f32, device dev = device::cpu());

  layer_memory& memory() { return mem_; }
  // With ep > 1 the values are the whole model's (the same seed gives every expert the same
  // values on whichever rank holds it), so a plan's weights are the single process's.
  void init_weights(std::uint64_t seed);
  void init_values(std::uint64_t seed, const init_sink& each) const;

  // The last forward's aux loss (before router_aux_loss_coef) and load statistics.
  double aux_loss() const { return ends().aux; }
  moe_load load() const;
  // Expert parallelism: every MoE layer's group (not owned; must outlive the model's use).
  void set_expert_exchange(moe_exchange* x);

 private:
  layer_memory mem_;
};

}  // namespace troupe::models
