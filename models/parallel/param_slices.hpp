// param_slices: moving a parameter between an unsharded model and a tensor-parallel shard of it,
// as the parameter's declaration says (param_spec in models/layers/slots.hpp): the whole of it
// when replicated, else the shard's part of each section along the split axis. Nothing here
// looks at a parameter's name or guesses from its shape; the shapes are only checked against the
// declaration.
#pragma once

#include <functional>
#include <string_view>

#include "models/layers/slots.hpp"
#include "models/parallel/tp_mappings.hpp"

namespace troupe::models {

// Copies between the unsharded parameter `full` and `shard`, shard `rank` of `tp` of it, as
// `shard_slot` (the shard's declaration of the parameter) says. into_shard: full's part into
// shard; else shard into full's part. Fails naming `what` and the parameter when the shapes do not
// agree with the declaration (full must be the shard's extents with the split axis, or each of
// its sections, times tp).
void copy_slice(const tensor_slot& shard_slot, const tensor& full, const tensor& shard, int rank,
                int tp, bool into_shard, std::string_view what);

// For every parameter of `piece` (a tp shard or a pipeline stage of any family): the parameter
// of the same name in `full` (full_grads: its gradient), copied by copy_slice for shard rank/tp
// into the piece's parameter (own_grads: its gradient) when into_piece, else the piece's into
// full's part. Fails naming `who` and the parameter when `full` lacks it.
void copy_slices_by_name(const slot_list& piece, const slot_list& full, bool full_grads,
                         bool own_grads, bool into_piece, const tp_group& tp, std::string_view who);

// init_weights of a piece without the unsharded model's memory: draw(sink) runs the unsharded
// model's init_values (an unbound gpt or llama: gpt_config::unbound) and every parameter the
// piece holds gets its part (copy_slice for shard tp) of the values drawn, rounded to the
// piece's dtype as init_weights rounds them: one whole parameter of scratch at a time.
void init_slices(const std::function<void(const init_sink&)>& draw, const slot_list& piece,
                 const tp_group& tp, std::string_view who);

// Whether every shard of a tensor-parallel group holds all of the parameter (its gradient is then
// the same on every shard, and one shard counts it in a norm).
inline bool replicated_over_tp(const tensor_slot& parameter) {
  return !parameter.spec.split;
}

}  // namespace troupe::models
