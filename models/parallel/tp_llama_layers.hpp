// The Llama pieces of a tensor shard, shared by tp_llama (parallelize_llama.hpp) and the pipeline's
// llama_stage: the SwiGLU MLP, the block and the head, on the layers of tp_layers.hpp.
//
//   tp_swiglu_mlp   gate_proj and up_proj column parallel (the shard's hidden/tp columns, their
//                   biases with them), down_proj row parallel; one entry, one exit (which holds
//                   down_proj's bias, replicated and added once after the reduction).
//   tp_llama_block  r = x + self_attn(input_layernorm(x)); y = r + mlp(post_attention_layernorm(r))
//                   with q/k/v split by heads (GQA: the shard's n_head/tp query and n_kv_head/tp
//                   key/value heads; RoPE per local head at the global positions 0..T-1, as the
//                   region sees the whole sequence), o_proj row parallel, RMSNorms replicated (SP:
//                   on the shard's T/tp rows).
//   tp_llama_head   logits = norm(x) @ W^T on the shard's vocabulary rows of W (lm_head's, or
//                   embed_tokens' when tied; SP: norm's output gathered first), loss =
//                   vocab-parallel cross-entropy (the same on every shard).
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
#include "models/parallel/tp_vocab.hpp"

namespace troupe::models {

// cfg with n_kv_head and head_dim resolved as llama does, checked for a shard of `tp`: tp must
// divide n_head, n_kv_head, intermediate_size and vocab_size (errors name parallel.tp and the
// field). `who` starts the messages.
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

struct tp_llama_head {
  tp_group tp;
  std::int64_t dim = 0;
  bool tied = false;  // the head is embed_tokens (tie_word_embeddings)
  sp_rmsnorm norm;
  tp_entry entry;
  vocab_parallel_cross_entropy loss;
  tensor weight, dweight;  // [V/tp, C]: declared by declare (weight_scope) or bound by the owner

  // cfg resolved.
  tp_llama_head(const llama_config& cfg, tp_group g);
  std::int64_t local_vocab() const { return loss.local_vocab; }
  // Declares "norm", "<weight_scope>.weight" (unless weight_scope is empty) and the activations.
  void declare(slot_list& s, batch_dims b, std::string_view weight_scope);
  // x [B, T, C] (SP: [B, T/tp, C]), targets [B, T] -> the mean loss.
  double forward(const tensor& x, const tensor& targets);
  tensor logits() const { return logits_cur_; }  // [B*T, V/tp]
  // d(loss_scale * loss)/d(x) into dx (shaped like x), scratch another such buffer; accumulates
  // the weight's and the norm's gradients.
  void backward(double loss_scale, const tensor& scratch, const tensor& dx);
  // A generation step's head: x [B, t, C] whole on every shard (also with SP) -> the shard's
  // vocabulary columns of the last position into logits [B, V/tp]. Overwrites the activations of
  // the last forward.
  void last_logits(const tensor& x, const tensor& logits);

 private:
  tensor norm_out_, logits_, norm_cur_, logits_cur_;
  std::int64_t b_ = 0, t_ = 0;
};

}  // namespace troupe::models
