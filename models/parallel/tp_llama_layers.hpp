// Llama's tensor-parallel layers, the block of its tensor shard and pipeline stage
// (parallelize_llama.hpp): the SwiGLU MLP and the block, on the layers of tp_layers.hpp.
//
//   tp_swiglu_mlp   gate_proj and up_proj column parallel (the shard's hidden/tp columns, their
//                   biases with them), down_proj row parallel; one entry, one exit (which holds
//                   down_proj's bias, replicated and added once after the reduction).
//   tp_llama_block  r = x + self_attn(input_layernorm(x)); y = r + mlp(post_attention_layernorm(r))
//                   with q/k/v split by heads (GQA: the shard's n_head/tp query and n_kv_head/tp
//                   key/value heads; RoPE per local head at the global positions 0..T-1, as the
//                   region sees the whole sequence), o_proj row parallel, RMSNorms replicated (SP:
//                   on the shard's T/tp rows).
// Parameter names and layouts are llama's (HF); each parameter declares how a shard holds it
// (param_spec): rows of q/k/v, gate/up (and their biases), embed_tokens and lm_head, columns of
// o_proj and down_proj, the whole of the norms and of o_proj's and down_proj's biases.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/layers/swiglu_mlp.hpp"
#include "models/llama.hpp"
#include "models/parallel/tp_layers.hpp"

namespace troupe::models {

// cfg resolved as llama does (llama_family::checked), checked for a shard of `tp`: tp must divide
// n_head, n_kv_head, intermediate_size and vocab_size (errors name `who`, parallel.tp and the
// field).
llama_config resolve_tp_llama_config(llama_config cfg, const tp_group& tp, std::string_view who);

struct tp_swiglu_mlp {
  swiglu_mlp::config cfg;  // the unsharded sizes
  tp_group tp;
  std::string label = "tp_swiglu_mlp";
  swiglu_mlp local;  // hidden/tp columns, down_proj without bias
  tp_entry entry;
  tp_exit exit;  // down_proj's bias (with mlp_bias)

  tp_swiglu_mlp() = default;
  tp_swiglu_mlp(const swiglu_mlp::config& c, tp_group g);
  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);
  void backward(const tensor& dy, const tensor& dx);
  void load_from(const swiglu_mlp& full);
  // forward through the region's full-sequence path (tp_compose.hpp, generation steps): x, y
  // [B, t, C] whole on every shard, also with SP.
  void forward_step(const tensor& x, const tensor& y);
};

struct tp_llama_block {
  tp_group tp;
  sp_rmsnorm input_layernorm, post_attention_layernorm;
  tp_attention self_attn;
  tp_swiglu_mlp mlp;
  residual_buffers buf;

  // cfg resolved (resolve_tp_llama_config).
  tp_llama_block(const llama_config& cfg, tp_group g);
  // recompute: the activations live in a recomputed scope (slots.hpp), shared with the other
  // recomputed blocks; call recompute(x) before backward (as llama_block).
  void declare(slot_list& s, std::string_view name, batch_dims b, bool recompute = false);
  // x, y [B, T, C] (SP: [B, T/tp, C]).
  void forward(const tensor& x, const tensor& y);
  // forward again from the same x without writing y (the tensor-parallel collectives included,
  // so every shard must recompute together): restores what backward reads.
  void recompute(const tensor& x) { forward(x, tensor{}); }
  void backward(const tensor& dy, const tensor& dx);  // dx may alias dy
  // forward for new positions start.. with the attention over the shard's kv cache, every shard
  // holding the step's rows whole (also with SP: the region's full-sequence path, tp_compose.hpp).
  void forward_step(const tensor& x, const tensor& y, const kv_layer& cache, std::int64_t start);

 private:
  tp_llama_block(const llama_block& unsharded, tp_group g);  // its layers' configs, sharded
};

}  // namespace troupe::models
