// parallelize_gpt: GPT-2 (models/gpt.hpp) split over a tensor-parallel group from outside the
// model. This file holds GPT-2's tensor-parallel parts (tp_parts<gpt_family>, tp_family.hpp); the
// placements that run them are generic: tp_gpt is tp_model<gpt_family> (tp_model.hpp), gpt_stage
// is stage<gpt_family> (gpt_stage.hpp).
//
//   front  x = wte[ids] (vocab parallel, allreduced; SP: reduce-scattered to [B, T/tp, C])
//              + wpe[the shard's positions]   (tp_gpt_front)
//   block  tp_gpt_block (tp_layers.hpp: heads and MLP columns split; SP: LayerNorms and
//          residuals on T/tp rows)
//   back   ln_f, the tied head on the shard's vocabulary rows of wte (SP: ln_f's output gathered
//          first) and the vocab-parallel cross-entropy (tp_head<layernorm>)
//
// Parameters keep gpt's names (wte.weight, h.0.attn.qkv_proj.weight, ...); a shard's parameter is
// the whole one where it is declared replicated (norms, wpe, row-parallel biases) and otherwise its
// slice (qkv rows by heads, fc rows, o_proj and mlp.proj columns, wte rows). Host (CPU) only: the
// vocab-parallel layers read ids and statistics with plain loops.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "models/gpt.hpp"
#include "models/layers/embedding.hpp"
#include "models/parallel/tp_head.hpp"
#include "models/parallel/tp_layers.hpp"
#include "models/parallel/tp_model.hpp"
#include "models/parallel/tp_vocab.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models {

// GPT-2's embeddings on a shard: the vocab-parallel wte and the learned positions wpe (whole on
// every shard). With SP a shard's rows are the positions rank * T/tp onwards; wpe's gradient adds
// every position's (the output gradient gathered over the group first).
struct tp_gpt_front {
  tp_group tp;
  std::int64_t dim;
  vocab_parallel_embedding wte;
  embedding wpe;
  owned_tensor positions;             // i32 0..max_seq-1
  tensor pos_emb;                     // activation [T_local, C]
  tensor dpos, dx0_full, gather_buf;  // backward scratch
  // Context parallelism (tp_trunk::set_context): i32 [T_local], the global positions of the
  // stage's tokens, read instead of 0..T-1; undefined: none.
  tensor context_positions;
  tensor row_positions;  // set_positions' (not owned)

  tp_gpt_front(const gpt_config& c, tp_group g);
  void declare(slot_list& s, batch_dims d);           // wte, wpe, pos_emb
  void declare_scratch(slot_list& s, batch_dims d);   // dpos (SP: dx0_full, dx0_gather_buf)
  void forward(const tensor& ids, const tensor& x0);  // x0 [B, T_local, C]
  void backward(const tensor& dx0);
  // Packed rows (tp_trunk::set_packing): each row's positions i32 [B, T] (whole rows, also with
  // SP: a shard reads its columns) for the forwards and backwards that follow; undefined: every
  // row at 0..T-1.
  void set_positions(const tensor& p) { row_positions = p; }
  // ids [B, n] at positions start.. -> x0 [B, n, C] whole on every shard (generation).
  void forward_step(const tensor& ids, std::int64_t start, const tensor& x0);
  vocab_parallel_embedding& tokens() { return wte; }
  const vocab_parallel_embedding& tokens() const { return wte; }

 private:
  void add_positions(const tensor& pos_ids, const tensor& x0);
};

template <>
struct tp_parts<gpt_family> {
  using block = tp_gpt_block;
  using front = tp_gpt_front;
  using back = tp_head<layernorm>;
  static constexpr std::string_view token_scope = "wte";  // the head is always tied
  static gpt_config checked(const gpt_config& c, const tp_group& tp, std::string_view who);
  static back::config head_config(const gpt_config& c);
  static std::string_view head_scope(const gpt_config&) { return token_scope; }
  static const attention& attention_of(const tp_gpt_block& b) { return b.attn.local; }
  // The sizes a plan is checked and partitioned with (scheduler/plan.hpp).
  static scheduler::model_shape shape(const gpt_config& c) {
    return {.layers = c.n_layer,
            .heads = c.n_head,
            .kv_heads = c.n_head,
            .hidden = c.dim,
            .vocab = c.vocab,
            .ffn = c.hidden > 0 ? c.hidden : 4 * c.dim};
  }
};

extern template class tp_trunk<gpt_family>;
extern template class tp_model<gpt_family>;
using tp_gpt = tp_model<gpt_family>;

// The shard of `model` for the group `tp` (sequence_parallel: SP as well), planned for `dims`.
std::unique_ptr<tp_gpt> parallelize_gpt(const gpt& model, batch_dims dims,
                                        collective::communicator& tp, bool sequence_parallel);

}  // namespace troupe::models
