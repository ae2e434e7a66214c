// parallelize_gpt: a GPT-2 (models/gpt.hpp) split over a tensor-parallel group from outside the
// model: tp_gpt runs the shard's part of every layer (tp_layers.hpp, tp_vocab.hpp) and takes its
// weights from an unsharded gpt by parameter name, so gpt itself holds no rank logic.
//
//   x = wte[ids] (vocab parallel, allreduced; SP: reduce-scattered to [B, T/tp, C]) + wpe
//   blocks: tp_gpt_block (heads and MLP columns split; SP: LayerNorms and residuals on T/tp rows)
//   logits = ln_f(x) @ wte_shard^T: the shard's vocabulary columns [B*T, V/tp] (tied head, SP:
//            ln_f's output gathered first); loss = vocab-parallel cross-entropy (the same on every
//            shard)
//
// Parameters keep gpt's names (wte.weight, h.0.attn.qkv_proj.weight, ...); a shard's parameter is
// the full one when the shapes agree (norms, wpe, row-parallel biases: replicated, their gradients
// equal on every shard), else its slice: qkv rows by heads, fc rows, o_proj and mlp.proj columns,
// wte rows. tp_gpt has gpt's training and generation interface (causal_lm_of<tp_gpt> drives it
// through the trainer and generate()). Generation (tp_generation.hpp): every shard runs a step's
// new positions whole, also with SP (the region's full-sequence path: a step need not divide tp;
// with SP a prompt longer than T/tp runs as several cached passes), its attention over a kv cache
// of its n_head/tp heads, wte's shard and wpe at the new positions in front, and the tied head on
// the last position, whose vocabulary columns are gathered so that step_logits returns the full
// [B, V] on every shard. With cfg.recompute the blocks' activations share one set of bytes
// (slots.hpp) and backward runs each block's forward (but the last's, still in those bytes) again
// first, as gpt does (all shards together: the recomputed forward holds the same collectives).
// Host (CPU) only: the vocab-parallel layers read ids and statistics with plain loops.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "models/block_use.hpp"
#include "models/gpt.hpp"
#include "models/parallel/param_slices.hpp"
#include "models/parallel/tp_generation.hpp"
#include "models/parallel/tp_layers.hpp"
#include "models/parallel/tp_vocab.hpp"

namespace troupe::models {

class tp_gpt {
 public:
  tp_gpt(const gpt_config& cfg, batch_dims dims, tp_group tp);
  tp_gpt(const tp_gpt&) = delete;
  tp_gpt& operator=(const tp_gpt&) = delete;

  const gpt_config& config() const { return cfg_; }
  const slot_list& slots() const { return slots_; }
  layer_memory& memory() { return mem_; }
  const tp_group& group() const { return tp_; }

  // The shard's part of `full`'s parameters (from_grads: of its gradients, written into this
  // model's gradients with to_grads), matched by name.
  void load_from(const slot_list& full, bool from_grads = false, bool to_grads = false);
  void load_from(const gpt& full) { load_from(full.slots()); }
  // The weights of gpt::init_weights(seed) (an unsharded model is built and sliced).
  void init_weights(std::uint64_t seed);

  // ids, targets: i32 [B, T] on the host, the same on every shard. Returns the mean loss.
  double forward(const tensor& ids, const tensor& targets);
  tensor logits() const { return logits_cur_; }  // the shard's columns [B*T, V/tp]
  void backward(double loss_scale = 1.0);
  // Called around every use of block i's parameters (models/block_use.hpp). Empty: not called.
  block_use_hook on_block_use;

  // Incremental decoding as gpt's (all shards together): begin_generation plans the shard's kv
  // cache for `batch` sequences of up to `capacity` positions (0: max_seq); step_logits runs new
  // tokens ids [B, t] (i32 on the host, the same on every shard, t <= the planned seq) at the next
  // positions and returns the logits of the last one, [B, V] on every shard (valid until the next
  // call). Steps reuse the training activations: run forward again before backward.
  void begin_generation(std::int64_t batch, std::int64_t capacity = 0);
  tensor step_logits(const tensor& ids);
  std::int64_t generated_length() const { return gen_ ? gen_->length() : 0; }

 private:
  gpt_config cfg_;
  batch_dims dims_;
  tp_group tp_;
  std::int64_t seq_local_;  // T / tp with SP, else T
  vocab_parallel_embedding wte_;
  embedding wpe_;
  std::vector<tp_gpt_block> h_;
  sp_layernorm ln_f_;
  tp_entry head_;  // copy_to_region (SP: gather_from_sequence) before the tied head
  vocab_parallel_cross_entropy loss_;
  owned_tensor pos_ids_;
  std::vector<tensor> x_;                              // residual stream, [B, T_local, C]
  tensor pos_emb_, ln_f_out_, logits_;                 // activations
  tensor dx_a_, dx_b_, dpos_, dx0_full_, gather_buf_;  // backward scratch
  tensor logits_cur_, ln_f_cur_;
  std::int64_t b_ = 0, t_ = 0;
  slot_list slots_;
  layer_memory mem_;
  std::unique_ptr<tp_generation> gen_;
};

// The shard of `model` for the group `tp` (sequence_parallel: SP as well), planned for `dims`.
std::unique_ptr<tp_gpt> parallelize_gpt(const gpt& model, batch_dims dims,
                                        collective::communicator& tp, bool sequence_parallel);

}  // namespace troupe::models
