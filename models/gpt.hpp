// gpt: a GPT-2 language model (HF GPT2LMHeadModel semantics) composed of the layers (pre-LN
// blocks, learned positions, GELU-tanh MLP, tied head), with its memory planned before step 1.
//
//   x = wte[ids] + wpe[0..T-1]
//   for each block: r = x + attn(ln_1(x)); x = r + mlp(ln_2(r))
//   logits = ln_f(x) @ wte^T ; loss = mean cross-entropy(logits, targets)
//
// As in HF: LayerNorm eps layer_norm_epsilon (1e-5), attention scale 1/sqrt(D), causal softmax,
// MLP width n_inner (default 4 C) with gelu_new, biases everywhere but the head. Dropout is not
// modelled (HF's defaults are used for training, but its reference numbers are taken in eval mode
// or with dropout 0).
//
// Loss: HF's `labels=input_ids` shifts internally (logits[:, :-1] against ids[:, 1:], mean over
// B x (T-1)). Here targets are explicit: pass next_token_targets(ids) (models/targets.hpp), whose
// last position is ignore_index -100, for exactly that loss.
//
// The embed -> blocks -> head composition is the trunk's (models/trunk.hpp); this file holds
// GPT-2's parts (gpt_block, gpt_ends, gpt_family) and the whole model (gpt). The model is plain:
// no rank logic. Parameter names follow HF GPT-2's structure with the layer
// names of models/layers (wte.weight, wpe.weight, h.0.ln_1.weight, h.0.attn.qkv_proj.weight,
// h.0.attn.o_proj.weight, h.0.mlp.fc.weight, h.0.mlp.proj.weight, ln_f.weight, ...; HF's c_attn,
// c_proj, c_fc); the projection weights are [out, in] as in torch nn.Linear (HF's Conv1D [in, out]
// layout is transposed when checkpoints are loaded). The fused qkv rows are q, then k, then v, as
// in HF's c_attn columns.
#pragma once

#include <cstdint>
#include <string_view>
#include <tuple>

#include "models/kv_cache.hpp"
#include "models/layers/attention.hpp"
#include "models/layers/cross_entropy.hpp"
#include "models/layers/embedding.hpp"
#include "models/layers/layernorm.hpp"
#include "models/layers/mlp.hpp"
#include "models/layers/residual.hpp"
#include "models/layers/slots.hpp"
#include "models/pre_norm_block.hpp"
#include "models/trunk.hpp"

namespace troupe::models {

struct gpt_config {
  std::int64_t vocab = 256;
  std::int64_t max_seq = 64;
  std::int64_t dim = 64;
  std::int64_t n_layer = 2;
  std::int64_t n_head = 4;
  double ln_eps = 1e-5;     // layer_norm_epsilon
  std::int64_t hidden = 0;  // n_inner: the MLP width (0: 4 * dim)
  double init_std = 0.02;   // initializer_range
  // Activation checkpointing per block: keep only each block's input (the residual stream) and
  // run the block's forward again right before its backward; all blocks share one set of
  // activation bytes.
  bool recompute = false;
  // Declare the slots only and bind no memory: the model then describes the names, shapes and
  // layout of its parameters (slots(), place_params) and draws init_values, and nothing else.
  bool unbound = false;
};

// r = x + attn(ln_1(x)); y = r + mlp(ln_2(r)), the pre-LN block of GPT-2 (with, as options,
// grouped-query heads and RoPE).
struct gpt_block : pre_norm_block<gpt_block> {
  struct config {
    std::int64_t dim = 0, n_head = 0, n_kv_head = 0;  // n_kv_head 0: same as n_head
    bool rope = false;
    double ln_eps = 1e-5;
    std::int64_t hidden = 0;  // MLP width (0: 4 * dim)
  };
  layernorm ln_1, ln_2;
  attention attn;
  mlp ff;
  residual_buffers buf;  // activations and backward scratch [B, T, C]

  explicit gpt_block(const config& c);
  auto parts() { return std::tie(ln_1, attn, ln_2, ff); }
  static constexpr const char* part_names[4] = {"ln_1", "attn", "ln_2", "mlp"};
  static constexpr const char* label = "gpt_block";
};

// The two ends of GPT-2 around its blocks: the token and position embeddings in front; the final
// norm, the tied head and the loss behind; their activations and backward scratch. The trunk
// (models/trunk.hpp) runs them around the blocks, in every placement. declare_front adds wte and
// wpe, declare_back ln_f, pos_emb, ln_f_out, logits, loss and the scratch dx_a, dx_b, dpos.
struct gpt_ends {
  explicit gpt_ends(const gpt_config& c);
  void declare_front(slot_list& s, batch_dims d);
  void declare_back(slot_list& s, batch_dims d);
  // x0 = wte[ids] + wpe[positions]; ids i32 [B, t], positions i32 [t] (every row) or [B, t] (per
  // row: packed rows restart positions per sequence), x0 [B, t, C].
  void embed(const tensor& ids, const tensor& positions, const tensor& x0);
  // ln_f, the tied head and the mean loss of x [B, T, C] (the last block's output) on targets.
  double head(const tensor& x, const tensor& targets);
  // The head's backward: dx gets d(x) (views of the planned scratch; spare is the other one).
  void head_backward(double loss_scale, tensor& dx, tensor& spare);
  // The embeddings' backward from d(x0) [B, T, C].
  void embed_backward(const tensor& dx0);
  // ln_f and the head on the last position of x [B, t, C]: logits [B, V] (decoding).
  tensor last_logits(const tensor& x);
  const tensor& head_weight() const { return wte.weight; }  // tied

  std::int64_t dim, vocab;
  embedding wte, wpe;
  layernorm ln_f;
  cross_entropy_loss loss;
  tensor pos_emb, ln_f_out, logits;  // activations
  tensor dx_a, dx_b, dpos;           // backward scratch [B, T, C]
  tensor logits_cur, ln_f_cur;       // views of the last head()
  tensor row_positions;              // the last embed's positions when per row [B, t]
};

class gpt;

// GPT-2's parts for the trunk (models/trunk.hpp): blocks "h.<i>", the ends above.
struct gpt_family {
  using config = gpt_config;
  using block = gpt_block;
  using ends = gpt_ends;
  using model = gpt;  // the whole model
  static constexpr const char* name = "gpt";
  static constexpr const char* label = "GPT-2";  // for logs
  static constexpr const char* block_scope = "h";
  static gpt_config checked(const gpt_config& c);
  static gpt_block::config block_config(const gpt_config& c);
  static const attention& attention_of(const gpt_block& b) { return b.attn; }
};

extern template class trunk<gpt_family>;

// The whole model: the trunk of GPT-2 with every slot bound in one layer_memory. forward,
// backward, logits, the hooks on_block_grads / on_block_use and generation (begin_generation,
// step_logits) are the trunk's.
class gpt : public trunk<gpt_family> {
 public:
  gpt(const gpt_config& cfg, batch_dims dims, dtype t = dtype::f32, device dev = device::cpu());

  layer_memory& memory() { return mem_; }

  // GPT-2 initialisation (GPT2PreTrainedModel._init_weights): N(0, init_std) weights and
  // embeddings, zero biases, unit norm weights, and the residual projections (c_proj of attention
  // and MLP) N(0, init_std / sqrt(2 n_layer)); deterministic in the seed.
  void init_weights(std::uint64_t seed);
  // The values init_weights(seed) gives, parameter after parameter in declaration order, into
  // `each` (which init_weights stores into the parameters); needs no memory (unbound).
  void init_values(std::uint64_t seed, const init_sink& each) const;

 private:
  layer_memory mem_;
};

}  // namespace troupe::models
