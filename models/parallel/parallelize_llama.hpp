// parallelize_llama: a Llama (models/llama.hpp) split over a tensor-parallel group from outside the
// model, as parallelize_gpt does for GPT-2: tp_llama runs the shard's part of every layer
// (tp_llama_layers.hpp) and takes its weights from an unsharded llama by parameter name.
//
//   x = embed_tokens[ids] (vocab parallel, allreduced; SP: reduce-scattered to [B, T/tp, C])
//   layers: tp_llama_block (q/k/v heads split with GQA, RoPE per local head, o_proj row parallel,
//           gate/up columns and down rows split; SP: RMSNorms and residuals on T/tp rows)
//   logits = norm(x) @ W^T on the shard's vocabulary rows [B*T, V/tp], W = lm_head (untied) or
//            embed_tokens (tie_embeddings); loss = vocab-parallel cross-entropy (the same on every
//            shard)
//
// Parameters keep llama's (HF) names and layouts; a shard's parameter is the full one when it is
// declared replicated (the RMSNorms, o_proj's and down_proj's biases) and otherwise its part
// (copy_slice, param_slices.hpp). tp must divide n_head, n_kv_head, intermediate_size and
// vocab_size, with SP also the sequence length (errors name parallel.tp and the field). With
// cfg.recompute the blocks' activations share one set of bytes (slots.hpp) and backward runs each
// block's forward (but the last's, still in those bytes) again first, between the block's
// before_backward and after_backward (all shards together: the recomputed forward holds the same
// collectives), as tp_gpt does. Generation as tp_gpt's (tp_generation.hpp): every shard runs a
// step's new positions whole, also with SP, its attention over a kv cache of its n_kv_head/tp heads
// (RoPE at the global positions), and the head's vocabulary columns of the last position are
// gathered into the full [B, V] on every shard. Host (CPU) only.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "models/block_use.hpp"
#include "models/llama.hpp"
#include "models/parallel/tp_generation.hpp"
#include "models/parallel/tp_llama_layers.hpp"
#include "models/parallel/tp_vocab.hpp"

namespace troupe::models {

class tp_llama {
 public:
  tp_llama(const llama_config& cfg, batch_dims dims, tp_group tp);
  tp_llama(const tp_llama&) = delete;
  tp_llama& operator=(const tp_llama&) = delete;

  const llama_config& config() const { return cfg_; }  // n_kv_head and head_dim resolved
  const slot_list& slots() const { return slots_; }
  layer_memory& memory() { return mem_; }
  const tp_group& group() const { return tp_; }

  // The shard's part of `full`'s parameters (from_grads: of its gradients, written into this
  // model's gradients with to_grads), matched by name.
  void load_from(const slot_list& full, bool from_grads = false, bool to_grads = false);
  void load_from(const llama& full) { load_from(full.slots()); }
  // The weights of llama::init_weights(seed) (an unsharded model is built and sliced).
  void init_weights(std::uint64_t seed);

  // ids, targets: i32 [B, T] on the host, the same on every shard. Returns the mean loss.
  double forward(const tensor& ids, const tensor& targets);
  tensor logits() const { return head_.logits(); }  // the shard's columns [B*T, V/tp]
  void backward(double loss_scale = 1.0);
  // Called around every use of block i's parameters (models/block_use.hpp). Empty: not called.
  block_use_hook on_block_use;

  // Incremental decoding as llama's, all shards together (see tp_gpt::begin_generation).
  void begin_generation(std::int64_t batch, std::int64_t capacity = 0);
  tensor step_logits(const tensor& ids);  // [B, V] on every shard
  std::int64_t generated_length() const { return gen_ ? gen_->length() : 0; }

 private:
  llama_config cfg_;
  batch_dims dims_;
  tp_group tp_;
  vocab_parallel_embedding embed_tokens_;
  std::vector<tp_llama_block> layers_;
  tp_llama_head head_;
  std::vector<tensor> x_;  // residual stream: x_[i] is the input of layer i; [B, T_local, C]
  tensor dx_a_, dx_b_;     // backward scratch
  std::int64_t b_ = 0, t_ = 0;
  slot_list slots_;
  layer_memory mem_;
  std::unique_ptr<tp_generation> gen_;
};

// The shard of `model` for the group `tp` (sequence_parallel: SP as well), planned for `dims`.
std::unique_ptr<tp_llama> parallelize_llama(const llama& model, batch_dims dims,
                                            collective::communicator& tp, bool sequence_parallel);

}  // namespace troupe::models
