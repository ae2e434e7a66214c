// tp_compose: what the tensor-parallel layers share, written once for GPT-2 and Llama
// (tp_layers.hpp, tp_llama_layers.hpp, the pipeline stages):
//
//   region     y = exit(local(entry(x))): a layer whose local part (an attention with its shard's
//              heads, an MLP with its shard's hidden columns) runs on the region's full rows and
//              whose output is a partial sum; entry is copy_to_region (SP: gather_from_sequence),
//              exit reduce_from_region (SP: reduce_scatter_to_sequence) and the bias.
//   shard_rows the shape of the shard's rows of the residual stream ([B, T, C], or with SP
//              [B, T/tp, C]), on which the pre-norm block (models/layers/residual.hpp) runs.
//   full-sequence path (generation steps, models/kv_cache.hpp)
//              every shard holds the step's new rows [B, t, C] whole, with sequence parallelism
//              too (t need not divide tp, and a step of one token is the common case): the region
//              is entered by identity (copy_to_region) and left by reduce_from_region and the
//              bias. cached_region and region_step make a layer's forward_step a layer for the
//              block's composition.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/kv_cache.hpp"
#include "models/layers/residual.hpp"
#include "models/layers/slots.hpp"
#include "models/parallel/tp_mappings.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

// Entry, Exit: tp_entry, tp_exit (tp_layers.hpp).
template <class Entry, class Local, class Exit>
void region_forward(Entry& entry, Local& local, Exit& exit, const tensor& x, const tensor& y) {
  tensor xf = entry.forward(x);
  tensor p = exit.partial_buffer(y);
  local.forward(xf, p);
  exit.forward(p, y);
}

template <class Entry, class Local, class Exit>
void region_backward(Entry& entry, Local& local, Exit& exit, const tensor& dy, const tensor& dx) {
  tensor dyf = exit.backward(dy);
  tensor dxr = entry.grad_buffer(dx);
  local.backward(dyf, dxr);
  entry.backward(dxr, dx);
}

// Attn::forward_step(x, y, cache, start) as a layer: the attention of a generation step.
template <class Attn>
struct cached_region {
  Attn& attn;
  const kv_layer& cache;
  std::int64_t start;
  void forward(const tensor& x, const tensor& y) const { attn.forward_step(x, y, cache, start); }
};

// Ff::forward_step(x, y) as a layer: the MLP of a generation step.
template <class Ff>
struct region_step {
  Ff& ff;
  void forward(const tensor& x, const tensor& y) const { ff.forward_step(x, y); }
};

// The shard's rows of a [B, T, C] activation planned for b: [B, T / tp, C] with sequence
// parallelism (tp must divide T: the error names `who` and the sequence length), else [B, T, C].
inline shape shard_rows(batch_dims b, std::int64_t dim, const tp_group& tp, std::string_view who) {
  const std::int64_t seq =
      tp.sequence_parallel ? divide_by_tp(b.seq, tp.size(), std::string(who) + ": sequence length")
                           : b.seq;
  return {b.batch, seq, dim};
}

}  // namespace troupe::models
