// tp_family: what a model family gives the tensor-parallel placements (the tensor shard tp_model,
// the pipeline stage stage<F>) beside the parts it gives the trunk (models/trunk.hpp).
//
// A family's plain parts live in models/ (gpt.hpp, llama.hpp), which never depends on this folder,
// so its tensor-parallel parts are named by a specialisation of tp_parts<F> next to them here
// (parallelize_gpt.hpp, parallelize_llama.hpp):
//
//   block        the tensor-parallel block, built from (F::block_config(cfg), tp_group), with the
//                plain block's interface (declare, forward, recompute, backward, forward_step) on
//                the shard's rows of the residual stream (shard_rows: [B, T, C], SP [B, T/tp, C]).
//   front        the embeddings: declare / declare_scratch, forward(ids, x0) on the shard's rows,
//                backward(dx0), forward_step(ids, start, x0) over whole rows (generation), and
//                tokens(): the vocab-parallel token embedding (its state is stashed with a
//                pipeline's microbatch; its weight is the tied head's).
//   back         tp_head<Norm> (tp_head.hpp): the final norm, the head and the loss.
//   checked      the config checked for a shard of the group (defaults resolved; errors name
//                `who` and parallel.tp), and head_config / head_scope / token_scope: the back's
//                sizes and the scopes its weight is declared under, untied and tied; shape: the
//                sizes a plan is checked and partitioned with (scheduler::model_shape).
//
// With tp_group{} (no communicator) every part is the unsharded one, so a pipeline stage without
// tensor parallelism is the same code.
#pragma once

#include <concepts>
#include <cstdint>
#include <string_view>

#include "models/kv_cache.hpp"
#include "models/layers/slots.hpp"
#include "models/parallel/tp_head.hpp"
#include "models/parallel/tp_mappings.hpp"
#include "models/trunk.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models {

// Specialised per family beside its tensor-parallel parts.
template <class F>
struct tp_parts;

template <class F>
concept tp_family = trunk_family<F> &&
    requires(const typename F::config& c, const tp_group& g, typename tp_parts<F>::block& b,
             typename tp_parts<F>::front& f, slot_list& s, batch_dims d, const tensor& t,
             const kv_layer& kv) {
  requires std::constructible_from < typename tp_parts<F>::block,
  decltype(F::block_config(c)), tp_group > ;
  requires std::constructible_from < typename tp_parts<F>::front,
  const typename F::config&, tp_group > ;
  { tp_parts<F>::checked(c, g, std::string_view{}) } -> std::same_as<typename F::config>;
  { tp_parts<F>::head_config(c) } -> std::same_as<typename tp_parts<F>::back::config>;
  { tp_parts<F>::head_scope(c) } -> std::convertible_to<std::string_view>;  // untied
  { tp_parts<F>::token_scope } -> std::convertible_to<std::string_view>;    // the front's
  { tp_parts<F>::attention_of(b) } -> std::same_as<const attention&>;       // the shard's heads
  { tp_parts<F>::shape(c) } -> std::same_as<scheduler::model_shape>;
  typename F::model;  // the whole model, whose init_values a piece slices
  b.declare(s, std::string_view{}, d, true);
  b.forward(t, t);
  b.recompute(t);
  b.backward(t, t);
  b.forward_step(t, t, kv, std::int64_t{0});
  f.declare(s, d);
  f.declare_scratch(s, d);
  f.forward(t, t);
  f.backward(t);
  f.forward_step(t, std::int64_t{0}, t);
  f.tokens().weight;
};

}  // namespace troupe::models
