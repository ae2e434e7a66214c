// parallelize_llama: Llama (models/llama.hpp) split over a tensor-parallel group from outside the
// model. This file holds Llama's tensor-parallel parts (tp_parts<llama_family>, tp_family.hpp); the
// placements that run them are generic: tp_llama is tp_model<llama_family> (tp_model.hpp),
// llama_stage is stage<llama_family> (llama_stage.hpp).
//
//   front  x = embed_tokens[ids] (vocab parallel, allreduced; SP: reduce-scattered to
//          [B, T/tp, C])   (tp_llama_front)
//   block  tp_llama_block (tp_llama_layers.hpp: q/k/v heads split with GQA, RoPE per local head at
//          the global positions, o_proj row parallel, gate/up columns and down rows split; SP:
//          RMSNorms and residuals on T/tp rows)
//   back   norm, the head on the shard's vocabulary rows of W = lm_head (untied) or embed_tokens
//          (tie_embeddings), the vocab-parallel cross-entropy (tp_head<rmsnorm>)
//
// Parameters keep llama's (HF) names and layouts; a shard's parameter is the whole one where it is
// declared replicated (the RMSNorms, o_proj's and down_proj's biases) and otherwise its part
// (copy_slice, param_slices.hpp). tp must divide n_head, n_kv_head, intermediate_size and
// vocab_size, with SP also the sequence length (errors name parallel.tp and the field). Host (CPU)
// only.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "models/llama.hpp"
#include "models/parallel/tp_head.hpp"
#include "models/parallel/tp_llama_layers.hpp"
#include "models/parallel/tp_model.hpp"
#include "models/parallel/tp_vocab.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models {

// Llama's embedding on a shard: the vocab-parallel embed_tokens (RoPE rotates in the attention).
struct tp_llama_front {
  vocab_parallel_embedding embed_tokens;

  tp_llama_front(const llama_config& c, tp_group g)
      : embed_tokens({.vocab = c.vocab, .dim = c.dim}, g) {}
  void declare(slot_list& s, batch_dims d) { embed_tokens.declare(s, "embed_tokens", d); }
  void declare_scratch(slot_list&, batch_dims) {}
  void forward(const tensor& ids, const tensor& x0) { embed_tokens.forward(ids, x0); }
  void backward(const tensor& dx0) { embed_tokens.backward(dx0); }
  void forward_step(const tensor& ids, std::int64_t, const tensor& x0) {
    embed_tokens.forward_full_sequence(ids, x0);
  }
  vocab_parallel_embedding& tokens() { return embed_tokens; }
  const vocab_parallel_embedding& tokens() const { return embed_tokens; }
};

template <>
struct tp_parts<llama_family> {
  using block = tp_llama_block;
  using front = tp_llama_front;
  using back = tp_head<rmsnorm>;
  static constexpr std::string_view token_scope = "embed_tokens";
  static llama_config checked(const llama_config& c, const tp_group& tp, std::string_view who) {
    return resolve_tp_llama_config(c, tp, who);
  }
  static back::config head_config(const llama_config& c) {
    return {.dim = c.dim,
            .vocab = c.vocab,
            .norm = {.dim = c.dim, .eps = c.rms_eps},
            .tied = c.tie_embeddings};
  }
  static std::string_view head_scope(const llama_config&) { return "lm_head"; }
  static const attention& attention_of(const tp_llama_block& b) { return b.self_attn.local; }
  // The sizes a plan is checked and partitioned with (scheduler/plan.hpp).
  static scheduler::model_shape shape(const llama_config& c) {
    return {.layers = c.n_layer,
            .heads = c.n_head,
            .kv_heads = c.n_kv_head > 0 ? c.n_kv_head : c.n_head,
            .hidden = c.dim,
            .vocab = c.vocab,
            .ffn = c.hidden,
            .gated_mlp = true};
  }
};

extern template class tp_trunk<llama_family>;
extern template class tp_model<llama_family>;
using tp_llama = tp_model<llama_family>;

// The shard of `model` for the group `tp` (sequence_parallel: SP as well), planned for `dims`.
std::unique_ptr<tp_llama> parallelize_llama(const llama& model, batch_dims dims,
                                            collective::communicator& tp, bool sequence_parallel);

}  // namespace troupe::models
