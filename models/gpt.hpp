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
// The model is plain: no rank logic. Parameter names follow HF GPT-2's structure with the layer
// names of models/layers (wte.weight, wpe.weight, h.0.ln_1.weight, h.0.attn.qkv_proj.weight,
// h.0.attn.o_proj.weight, h.0.mlp.fc.weight, h.0.mlp.proj.weight, ln_f.weight, ...; HF's c_attn,
// c_proj, c_fc); the projection weights are [out, in] as in torch nn.Linear (HF's Conv1D [in, out]
// layout is transposed when checkpoints are loaded). The fused qkv rows are q, then k, then v, as
// in HF's c_attn columns.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "models/block_use.hpp"
#include "models/kv_cache.hpp"
#include "models/layers/attention.hpp"
#include "models/layers/cross_entropy.hpp"
#include "models/layers/embedding.hpp"
#include "models/layers/layernorm.hpp"
#include "models/layers/mlp.hpp"
#include "models/layers/residual.hpp"
#include "models/layers/slots.hpp"

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
struct gpt_block {
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

// The two ends of GPT-2 around its blocks: the token and position embeddings in front; the final
// norm, the tied head and the loss behind; their activations and backward scratch. gpt runs them
// around its blocks, models/offload's streamed_gpt one unit at a time. The slots are gpt's:
// declare_front adds wte and wpe, declare_back ln_f, pos_emb, ln_f_out, logits, loss and the
// scratch dx_a, dx_b, dpos.
struct gpt_ends {
  explicit gpt_ends(const gpt_config& c);
  void declare_front(slot_list& s, batch_dims d);
  void declare_back(slot_list& s, batch_dims d);
  // x0 = wte[ids] + wpe[positions]; ids i32 [B, t], positions i32 [t], x0 [B, t, C].
  void embed(const tensor& ids, const tensor& positions, const tensor& x0);
  // ln_f, the tied head and the mean loss of x [B, T, C] (the last block's output) on targets.
  double head(const tensor& x, const tensor& targets);
  // The head's backward: dx gets d(x) (views of the planned scratch; spare is the other one).
  void head_backward(double loss_scale, tensor& dx, tensor& spare);
  // The embeddings' backward from d(x0) [B, T, C].
  void embed_backward(const tensor& dx0);

  std::int64_t dim, vocab;
  embedding wte, wpe;
  layernorm ln_f;
  cross_entropy_loss loss;
  tensor pos_emb, ln_f_out, logits;  // activations
  tensor dx_a, dx_b, dpos;           // backward scratch [B, T, C]
  tensor logits_cur, ln_f_cur;       // views of the last head()
};

class gpt {
 public:
  gpt(const gpt_config& cfg, batch_dims dims, dtype t = dtype::f32, device dev = device::cpu());
  gpt(const gpt&) = delete;
  gpt& operator=(const gpt&) = delete;

  const gpt_config& config() const { return cfg_; }
  const slot_list& slots() const { return slots_; }
  layer_memory& memory() { return mem_; }

  // GPT-2 initialisation (GPT2PreTrainedModel._init_weights): N(0, init_std) weights and
  // embeddings, zero biases, unit norm weights, and the residual projections (c_proj of attention
  // and MLP) N(0, init_std / sqrt(2 n_layer)); deterministic in the seed.
  void init_weights(std::uint64_t seed);
  // The values init_weights(seed) gives, parameter after parameter in declaration order, into
  // `each` (which init_weights stores into the parameters); needs no memory (unbound).
  void init_values(std::uint64_t seed, const init_sink& each) const;

  // ids, targets: i32 [B, T] on the model's device (T <= max_seq, B <= the planned batch).
  // Returns the mean loss; keeps what backward needs.
  double forward(const tensor& ids, const tensor& targets);
  // Logits of the last forward, [B*T, V] (overwritten by backward).
  tensor logits() const { return ends_.logits_cur; }
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

  // Incremental decoding with a kv cache. begin_generation plans a cache for `batch` sequences of
  // up to `capacity` positions (0: max_seq) and empties it; step_logits runs new tokens ids
  // [B, t] (i32, B <= batch, t <= the planned seq) at the next positions and returns the logits
  // of the last one, [B, V] (valid until the next call). The prompt is one step, each sampled
  // token another. Steps reuse the training activations: run forward again before backward.
  void begin_generation(std::int64_t batch, std::int64_t capacity = 0);
  tensor step_logits(const tensor& ids);
  std::int64_t generated_length() const { return cache_ ? cache_->length() : 0; }

 private:
  gpt_config cfg_;
  batch_dims dims_;
  gpt_ends ends_;
  std::vector<gpt_block> h_;
  owned_tensor pos_ids_;   // i32 [max_seq]: 0..max_seq-1
  std::vector<tensor> x_;  // residual stream: x_[i] is the input of block i; [B, T, C]
  std::int64_t b_ = 0, t_ = 0;
  slot_list slots_;
  layer_memory mem_;
  std::unique_ptr<kv_cache> cache_;
  dtype dtype_;
  device dev_;
};

}  // namespace troupe::models
