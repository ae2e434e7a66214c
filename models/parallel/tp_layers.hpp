// Megatron-style 1-D tensor-parallel layers: column- and row-parallel linear, the MLP, attention
// with the heads split across shards, the sequence-parallel LayerNorm and the GPT-2 block.
//
// Each layer runs the shard's part of the unsharded layer of models/layers and meets the other
// shards in the mappings of tp_mappings.hpp:
//   column_parallel_linear  W [out/tp, in] rows of W; input through copy_to_region (SP:
//                           gather_from_sequence); output the local columns, or all of them
//                           (gather_output, not with SP).
//   row_parallel_linear     W [out, in/tp] columns of W; input the local columns; output through
//                           reduce_from_region (SP: reduce_scatter_to_sequence); bias added once,
//                           after the reduction.
//   tp_mlp                  column(fc) -> gelu -> row(proj): one entry, one exit.
//   tp_attention            q/k/v heads split (Hq/tp query and Hkv/tp kv heads per shard, GQA
//                           included), o_proj row parallel; one entry, one exit.
//   sp_layernorm            a LayerNorm (sp_rmsnorm: an RMSNorm) on the shard's rows; with SP its
//                           weight and bias gradients are partial sums, allreduced over the group
//                           in backward.
//   tp_gpt_block            r = x + attn(ln_1(x)); y = r + mlp(ln_2(r)); x and y are full [B, T,
//                           C] (replicated) or, with SP, the shard's [B, T/tp, C].
// Parameters: `load_from(full)` copies the shard's slice of an unsharded layer's weights (HF
// layout, [out, in]); the slicing functions of tp_mappings.hpp give the same slice of any tensor,
// e.g. of the unsharded gradients. The layers declare their memory like the unsharded ones
// (declare with the full batch_dims: the sequence-parallel extents are derived).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/gpt.hpp"
#include "models/kv_cache.hpp"
#include "models/layers/attention.hpp"
#include "models/layers/layernorm.hpp"
#include "models/layers/linear.hpp"
#include "models/layers/mlp.hpp"
#include "models/layers/rmsnorm.hpp"
#include "models/layers/slots.hpp"
#include "models/parallel/tp_compose.hpp"
#include "models/parallel/tp_mappings.hpp"

namespace troupe::models {

// Entering a region: copy_to_region, or with SP gather_from_sequence. Declared in the scope of
// the layer that owns it.
struct tp_entry {
  tp_group tp;
  std::string label;
  std::int64_t dim = 0;
  tensor x_full;            // SP: the gathered input [B, T, dim] (activation, read by backward)
  tensor dx_full, scratch;  // SP: backward scratch [B, T, dim] and the collectives' buffer

  void declare(slot_list& s, batch_dims b, std::int64_t width, const std::string& owner);
  // x [B, T, dim] (SP: [B, T/tp, dim]) -> the region's input [B, T, dim].
  tensor forward(const tensor& x);
  // Where the region writes the gradient of its input, for a given dx (undefined if not needed).
  tensor grad_buffer(const tensor& dx) const;
  // Completes dx from the buffer grad_buffer(dx) returned: allreduce (SP: reduce_scatter).
  void backward(const tensor& dx_region, const tensor& dx);
};

// Leaving a region: reduce_from_region, or with SP reduce_scatter_to_sequence; then the bias.
struct tp_exit {
  tp_group tp;
  std::string label;
  std::int64_t dim = 0;
  bool has_bias = true;
  tensor bias, dbias;                // [dim], replicated
  tensor full, dbias_part, scratch;  // SP: [B, T, dim], [dim] and the collectives' buffer

  // Declares the bias as "<bias_scope>.bias" and the buffers in the current scope.
  void declare(slot_list& s, batch_dims b, std::int64_t width, bool with_bias,
               std::string_view bias_scope, const std::string& owner);
  // Where the region writes its partial output for a given y.
  tensor partial_buffer(const tensor& y) const;
  void forward(const tensor& partial, const tensor& y);
  // The region's output gradient for dy (SP: gathered); accumulates dbias.
  tensor backward(const tensor& dy);
  // reduce_from_region whatever the group's sequence parallelism: y holds the shard's partial sum
  // of rows every shard holds whole (a generation step's) and gets their sum and the bias.
  void forward_full_sequence(const tensor& y);
};

struct column_parallel_linear {
  struct config {
    std::int64_t in = 0, out = 0;
    bool bias = true;
    bool gather_output = false;  // y is [..., out] on every shard (not with SP)
  };
  config cfg;
  tp_group tp;
  std::string label = "column_parallel_linear";
  linear local;  // in -> out/tp
  tp_entry entry;
  tensor y_local, dy_local, scratch;  // gather_output: [rows, out/tp] and [rows, out] buffers

  column_parallel_linear() = default;
  column_parallel_linear(const config& c, tp_group g);
  void declare(slot_list& s, std::string_view name, batch_dims b);
  // x [B, T, in] (SP: [B, T/tp, in]) -> y [B, T, out/tp] (gather_output: [B, T, out]).
  void forward(const tensor& x, const tensor& y);
  void backward(const tensor& dy, const tensor& dx);
  void load_from(const linear& full);
};

struct row_parallel_linear {
  struct config {
    std::int64_t in = 0, out = 0;
    bool bias = true;
  };
  config cfg;
  tp_group tp;
  std::string label = "row_parallel_linear";
  linear local;  // in/tp -> out, no bias
  tp_exit exit;  // holds the bias

  row_parallel_linear() = default;
  row_parallel_linear(const config& c, tp_group g);
  void declare(slot_list& s, std::string_view name, batch_dims b);
  // x [B, T, in/tp] -> y [B, T, out] (SP: [B, T/tp, out]).
  void forward(const tensor& x, const tensor& y);
  void backward(const tensor& dy, const tensor& dx);
  void load_from(const linear& full);
};

struct tp_mlp {
  mlp::config cfg;  // the unsharded sizes
  tp_group tp;
  std::string label = "tp_mlp";
  column_parallel_linear fc;
  row_parallel_linear proj;
  tensor h, a;    // activations [rows, hidden/tp]
  tensor da, dh;  // scratch

  tp_mlp() = default;
  tp_mlp(const mlp::config& c, tp_group g);
  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);
  void backward(const tensor& dy, const tensor& dx);
  void load_from(const mlp& full);
  // forward through the region's full-sequence path (tp_compose.hpp, generation steps): x, y
  // [B, t, C] whole on every shard, also with SP.
  void forward_step(const tensor& x, const tensor& y);
};

struct tp_attention {
  attention::config cfg;  // the unsharded sizes
  tp_group tp;
  std::string label = "tp_attention";
  attention local;  // Hq/tp and Hkv/tp heads, o_proj without bias
  tp_entry entry;
  tp_exit exit;  // the o_proj bias

  tp_attention() = default;
  tp_attention(const attention::config& c, tp_group g);
  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);
  void backward(const tensor& dy, const tensor& dx);
  void load_from(const attention& full);
  // forward for new positions start..start+t-1 through the region's full-sequence path
  // (tp_compose.hpp): x, y [B, t, C] whole on every shard, also with SP; the shard's heads attend
  // over `cache` (its Hkv/tp heads, models/kv_cache.hpp) and append their k and v to it.
  void forward_step(const tensor& x, const tensor& y, const kv_layer& cache, std::int64_t start);
};

// A LayerNorm or RMSNorm (Norm) on the shard's rows (sp_layernorm, sp_rmsnorm).
template <class Norm>
struct sp_norm {
  tp_group tp;
  Norm norm;
  tensor dw_part, db_part;  // SP: scratch for the partial gradients

  sp_norm() = default;
  sp_norm(const typename Norm::config& c, tp_group g) : tp(g), norm(c) {}
  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y) { norm.forward(x, y); }
  void backward(const tensor& dy, const tensor& dx);
  void load_from(const Norm& full);
};
using sp_layernorm = sp_norm<layernorm>;
using sp_rmsnorm = sp_norm<rmsnorm>;

struct tp_gpt_block {
  tp_group tp;
  sp_layernorm ln_1, ln_2;
  tp_attention attn;
  tp_mlp ff;
  residual_buffers buf;

  tp_gpt_block(const gpt_block::config& c, tp_group g);
  // recompute: the activations live in a recomputed scope (slots.hpp), shared with the other
  // recomputed blocks; call recompute(x) before backward (as gpt_block).
  void declare(slot_list& s, std::string_view name, batch_dims b, bool recompute = false);
  void forward(const tensor& x, const tensor& y);
  // forward again from the same x without writing y (the tensor-parallel collectives included,
  // so every shard must recompute together): restores what backward reads.
  void recompute(const tensor& x);
  void backward(const tensor& dy, const tensor& dx);  // dx may alias dy
  void load_from(const gpt_block& full);
  // forward for new positions start.. with the attention over the shard's kv cache, every shard
  // holding the step's rows whole (also with SP: the region's full-sequence path, tp_compose.hpp).
  void forward_step(const tensor& x, const tensor& y, const kv_layer& cache, std::int64_t start);
};

}  // namespace troupe::models
