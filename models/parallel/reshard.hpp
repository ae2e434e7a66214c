// reshard: moving per-parameter state (weights, gradients, AdamW moments: anything laid out like a
// flat parameter buffer) between a whole model's layout and a piece's - a tensor-parallel shard, a
// pipeline stage, or a shard of a stage - by parameter name. Checkpoints use it to write one HF
// layout whatever the plan, and to load it under another plan.
//
// A piece's parameter is matched to the whole model's parameter of the same name and copied with
// copy_gpt_slice (parallelize_gpt.hpp), the rules tp_gpt, gpt_stage, tp_llama and llama_stage
// slice by: the whole of it when the shapes agree (stages, replicated tensors such as LayerNorms
// and RMSNorms on every shard), else GPT-2's fused q/k/v projection by heads, or a slice along dim
// 0 (Llama's q/k/v_proj by heads, GQA included, gate/up_proj, embed_tokens, lm_head) or dim 1
// (o_proj, down_proj). Names the piece lacks are someone else's.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>

#include "models/layers/slots.hpp"

namespace troupe::models::parallel {

struct piece_layout {
  const slot_list* slots = nullptr;  // the piece's parameters
  tensor base;                       // the piece's flat parameter buffer (offsets are from it)
  int tp_rank = 0, tp = 1;
  std::int64_t n_head = 0;  // for GPT-2's fused qkv projections (unused for Llama)
  // Whether this piece writes `parameter` when gathering (of the ranks holding a replicated
  // parameter exactly one should); empty: every parameter.
  std::function<bool(std::string_view)> owns;
};

struct whole_layout {
  const slot_list* slots = nullptr;  // the whole model's parameters
  tensor base;                       // its flat parameter buffer
};

// Where `field` (a view into the flat buffer `base`) starts in it, in elements; fails naming both
// when it lies outside.
std::int64_t offset_in(const tensor& field, const tensor& base);

// For every parameter of the piece: its part of `from` (laid out like whole.base) into `to` (laid
// out like piece.base). Fails naming the parameter when the whole model lacks it or no rule fits.
void scatter_to_piece(const whole_layout& whole, const tensor& from, const piece_layout& piece,
                      const tensor& to);

// For every parameter the piece owns: its part from `from` (laid out like piece.base) into its
// place in `to` (laid out like whole.base); the rest of `to` is left as it is.
void gather_from_piece(const piece_layout& piece, const tensor& from, const whole_layout& whole,
                       const tensor& to);

}  // namespace troupe::models::parallel
