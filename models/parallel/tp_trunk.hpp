// tp_trunk: the residual stream of models/trunk.hpp over a family's tensor-parallel parts
// (tp_family.hpp), for the blocks a placement holds: the tensor shard (tp_model.hpp: every block,
// both ends, one span) and the pipeline stage (stage.hpp: one span per chunk, the front on virtual
// stage 0, the back on the last).
//
//   x.<first> = front(ids) (span.front), else the caller's input copied in
//   x.<i+1> = block_i(x.<i>), i = first..end-1 (the last block of a span without the back writes
//             the caller's y instead)
//   loss = back(x.<n_layer>, targets) (span.back)
//
// Every activation is the shard's rows of the residual stream (shard_rows: [B, T, C], with
// sequence parallelism [B, T/tp, C]); a generation step's rows are whole on every shard (the
// region's full-sequence path, tp_compose.hpp). The tp_trunk declares into its placement's
// slot_list and binds nothing: parameters keep the whole model's names and order (front, blocks,
// norm, head weight), so a piece's weights move by name (param_slices.hpp) and checkpoints do not
// depend on the placement.
//
// Why a second trunk rather than the trunk with a tp placement: the trunk runs the whole model's
// plain parts in its memory (bit for bit the single process, on any device) and decodes with the
// model's own cache; the tensor-parallel parts run on the host over a group, decode with the
// shard's cache and logits gathered over the group (tp_generation.hpp), and are cut into spans.
// What the two share is the order of the parts, which each states in a few lines; the family's
// parts themselves are shared (the tp layers wrap the plain layers of models/layers).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "memory/error.hpp"
#include "models/block_use.hpp"
#include "models/parallel/tp_compose.hpp"
#include "models/parallel/tp_family.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

// Blocks [first, end) with the front before them and/or the back after them.
struct block_span {
  std::int64_t first = 0, end = 0;
  bool front = false, back = false;
};

template <tp_family F>
class tp_trunk {
 public:
  using config_type = typename F::config;
  using parts = tp_parts<F>;
  using block_type = typename parts::block;
  using front_type = typename parts::front;
  using back_type = typename parts::back;
  using cache_of = std::function<const kv_layer&(std::int64_t block)>;

  // cfg checked for the group (parts::checked); dims: the planned batch; `who` starts errors.
  tp_trunk(const config_type& cfg, batch_dims dims, tp_group tp, std::string who);
  tp_trunk(const tp_trunk&) = delete;
  tp_trunk& operator=(const tp_trunk&) = delete;

  const config_type& config() const { return cfg_; }
  const std::string& who() const { return who_; }
  const shape& rows() const { return rows_; }  // the shard's rows of the planned batch
  front_type& front() { return front_; }
  back_type& back() { return back_; }
  const back_type& back() const { return back_; }
  // The attention of a held block: the shard's key/value heads and the head size.
  const attention& attention_of() const;
  // Block i (global index) where held, else null.
  block_type* block(std::int64_t i) { return blocks_[static_cast<std::size_t>(i)].get(); }

  // Declares a span: the front, per block "x.<i>" and the block "<scope>.<i>" (recompute: in a
  // recomputed scope, slots.hpp), then "x.<n_layer>" and the back. Spans in block order.
  void declare(slot_list& s, block_span span, bool recompute);
  // Context parallelism (models/parallel/context_pipeline.hpp; an unsharded trunk only): the
  // tokens are the positions `positions` (i32 [T], the planned seq; kept, not copied) of each
  // sample, which a front with learned positions reads; every held block's attention exchanges
  // its heads through exchange(i) (Ulysses) or runs its core through `ring` (attention.hpp).
  void set_context(const tensor& positions,
                   const std::function<sequence_exchange*(std::int64_t block)>& exchange,
                   sequence_ring* ring);
  // After the spans: the backward scratch (dx_a, dx_b, the front's).
  void declare_scratch(slot_list& s);
  // After the memory is bound: a tied head held with the front reads the front's token embedding.
  void bind_tied_head();
  // Packed rows (several sequences per row, as trunk::set_packing) for the span's forwards and
  // backwards that follow: segments and positions i32 [B, T] on the host, the whole rows (also
  // with SP: the attention runs over every position of the shard's heads), kept intact until
  // those backwards. The span's blocks attend within a segment only; a front that reads
  // positions (GPT-2's learned ones) takes each row's own. Undefined: one sequence per row.
  void set_packing(block_span span, const tensor& segments, const tensor& positions);
  // A tied head's parameter held here ("<token_scope>.weight") and this piece's gradient of it
  // (the front's, else the back's copy); "" when untied or neither end is held.
  std::string tied_name() const;
  tensor tied_grad() const;

  // Forward of a span on a batch d (at most the planned one): in is the ids [B, T] (span.front) or
  // the previous span's output [rows]; y (when defined) receives the output unless span.back.
  // Returns the loss (span.back), else 0. `use` is notified around every block.
  double forward(block_span span, batch_dims d, const tensor& in, const tensor& targets,
                 const tensor& y, const block_use_hook& use = {});
  // Backward of the span's last forward: dy the output's gradient (unless span.back), dx receives
  // the input's (unless span.front). recompute: each block but the model's last runs its forward
  // again first. after_block(i) once block i's gradients are added.
  void backward(block_span span, batch_dims d, double loss_scale, const tensor& dy,
                const tensor& dx, bool recompute, const block_use_hook& use = {},
                const std::function<void(std::int64_t)>& after_block = {});
  // A generation pass of a span over new positions start.. (in: ids [B, n] or [B, n, C]), each
  // block over cache(i); y (when defined) receives the output unless span.back, which writes the
  // shard's vocabulary columns of the last position into logits [B, V/tp].
  void step(block_span span, const tensor& in, const tensor& y, std::int64_t start,
            const cache_of& cache, const tensor& logits);
  // The back alone on the last pass's output x.<n_layer> [B, n, C] (several passes, one head).
  void step_head(std::int64_t b, std::int64_t n, const tensor& logits);

 private:
  tensor x(std::int64_t i, const shape& s) const { return planned_view(x_[i], s, who_, "x"); }
  // Block i is the span's last and the span hands its output on (the caller's y).
  static bool writes_y(block_span span, std::int64_t i, const tensor& y) {
    return i + 1 == span.end && !span.back && y.defined();
  }

  std::string who_;
  config_type cfg_;
  batch_dims dims_;
  tp_group tp_;
  shape rows_;
  front_type front_;
  back_type back_;
  std::vector<std::unique_ptr<block_type>> blocks_;  // by global index; null where not held
  std::vector<tensor> x_;  // x_[i]: the input of block i; x_[n_layer]: of the back
  tensor dx_a_, dx_b_;     // backward scratch [rows]
  bool has_front_ = false, has_back_ = false;
};

// ---- definitions (instantiated with the families' tp parts) ------------------------------------

template <tp_family F>
tp_trunk<F>::tp_trunk(const config_type& cfg, batch_dims dims, tp_group tp, std::string who)
    : who_(std::move(who)),
      cfg_(parts::checked(cfg, tp, who_)),
      dims_(dims),
      tp_(tp),
      rows_(shard_rows(dims, cfg_.dim, tp, who_)),
      front_(cfg_, tp),
      back_(parts::head_config(cfg_), tp) {
  TROUPE_CHECK(dims.batch > 0 && dims.seq > 0 && dims.seq <= cfg_.max_seq, who_, ": the planned ",
               "batch [", dims.batch, ", ", dims.seq, "] must be positive with seq <= max_seq (",
               cfg_.max_seq, ")");
  blocks_.resize(static_cast<std::size_t>(cfg_.n_layer));
  x_.resize(static_cast<std::size_t>(cfg_.n_layer) + 1);
}

template <tp_family F>
const attention& tp_trunk<F>::attention_of() const {
  for (const auto& b : blocks_)
    if (b) return parts::attention_of(*b);
  throw error(who_ + ": holds no block");
}

template <tp_family F>
void tp_trunk<F>::declare(slot_list& s, block_span span, bool recompute) {
  if (span.front) {
    front_.declare(s, dims_);
    has_front_ = true;
  }
  for (std::int64_t i = span.first; i < span.end; ++i) {
    blocks_[i] = std::make_unique<block_type>(F::block_config(cfg_), tp_);
    s.activation("x." + std::to_string(i), rows_, x_[i]);
    const auto mark = s.mark_block(i);
    blocks_[i]->declare(s, std::string(F::block_scope) + "." + std::to_string(i), dims_, recompute);
  }
  if (!span.back) return;
  s.activation("x." + std::to_string(cfg_.n_layer), rows_, x_[cfg_.n_layer]);
  // Tied: the head is the front's embedding (held here too) or this piece's copy of it.
  back_.declare(s, dims_,
                !back_.cfg.tied ? parts::head_scope(cfg_)
                                : (has_front_ ? std::string_view{} : parts::token_scope));
  has_back_ = true;
}

template <tp_family F>
void tp_trunk<F>::set_context(const tensor& positions,
                              const std::function<sequence_exchange*(std::int64_t block)>& exchange,
                              sequence_ring* ring) {
  TROUPE_CHECK(tp_.size() == 1, who_, ": context parallelism runs on unsharded stages only ",
               "(parallel.cp with parallel.tp = ", tp_.size(), " is not written yet)");
  TROUPE_CHECK(!positions.defined() ||
                   (positions.type() == dtype::i32 && positions.sizes() == shape({dims_.seq})),
               who_, ": context positions must be i32 [", dims_.seq, "], got ",
               describe(positions));
  for (std::size_t i = 0; i < blocks_.size(); ++i) {
    if (!blocks_[i]) continue;
    auto& a = const_cast<attention&>(parts::attention_of(*blocks_[i]));
    a.exchange = exchange ? exchange(static_cast<std::int64_t>(i)) : nullptr;
    a.ring = ring;
  }
  if constexpr (requires { front_.context_positions; }) front_.context_positions = positions;
}

template <tp_family F>
void tp_trunk<F>::declare_scratch(slot_list& s) {
  s.scratch("dx_a", rows_, dx_a_);
  s.scratch("dx_b", rows_, dx_b_);
  if (has_front_) front_.declare_scratch(s, dims_);
}

template <tp_family F>
void tp_trunk<F>::bind_tied_head() {
  if (!back_.cfg.tied || !has_front_ || !has_back_) return;
  back_.weight = front_.tokens().weight;
  back_.dweight = front_.tokens().dweight;
}

template <tp_family F>
void tp_trunk<F>::set_packing(block_span span, const tensor& segments, const tensor& positions) {
  TROUPE_CHECK(segments.defined() == positions.defined(), who_,
               ": packed rows need both segments and positions, or neither");
  // The blocks are this trunk's own (non-const) objects; attention_of gives const access for the
  // kv cache's sizes, and the segments are the one per-batch input the attention takes.
  for (std::int64_t i = span.first; i < span.end; ++i)
    const_cast<attention&>(parts::attention_of(*blocks_[i])).segments = segments;
  if constexpr (requires { front_.set_positions(positions); })
    if (span.front) front_.set_positions(positions);
}

template <tp_family F>
std::string tp_trunk<F>::tied_name() const {
  if (!back_.cfg.tied || !(has_front_ || has_back_)) return {};
  return std::string(parts::token_scope) + ".weight";
}

template <tp_family F>
tensor tp_trunk<F>::tied_grad() const {
  if (tied_name().empty()) return {};
  return has_front_ ? front_.tokens().dweight : back_.dweight;
}

template <tp_family F>
double tp_trunk<F>::forward(block_span span, batch_dims d, const tensor& in, const tensor& targets,
                            const tensor& y, const block_use_hook& use) {
  const shape bt = shard_rows(d, cfg_.dim, tp_, who_);
  if (span.front)
    front_.forward(in, x(span.first, bt));
  else
    ops::copy(in, x(span.first, bt));
  for (std::int64_t i = span.first; i < span.end; ++i) {
    notify(use, i, block_use::before_forward);
    blocks_[i]->forward(x(i, bt), writes_y(span, i, y) ? y : x(i + 1, bt));
    notify(use, i, block_use::after_forward);
  }
  return span.back ? back_.forward(x(cfg_.n_layer, bt), targets) : 0.0;
}

template <tp_family F>
void tp_trunk<F>::backward(block_span span, batch_dims d, double loss_scale, const tensor& dy,
                           const tensor& dx, bool recompute, const block_use_hook& use,
                           const std::function<void(std::int64_t)>& after_block) {
  const shape bt = shard_rows(d, cfg_.dim, tp_, who_);
  const tensor da = planned_view(dx_a_, bt, who_, "dx_a"),
               db = planned_view(dx_b_, bt, who_, "dx_b");
  tensor g = dy;
  if (span.back) {
    back_.backward(loss_scale, da, db);
    g = db;
  }
  for (std::int64_t i = span.end - 1; i >= span.first; --i) {
    notify(use, i, block_use::before_backward);
    // The model's last block's activations are still those of the forward: the back's buffers
    // are not the blocks' shared activation bytes (scratch has its own arena).
    if (recompute && i + 1 < cfg_.n_layer) blocks_[i]->recompute(x(i, bt));
    tensor out = i == span.first && !span.front ? dx : (g.data() == da.data() ? db : da);
    blocks_[i]->backward(g, out);
    if (after_block) after_block(i);
    notify(use, i, block_use::after_backward);
    g = out;
  }
  if (span.front) front_.backward(g);
}

template <tp_family F>
void tp_trunk<F>::step(block_span span, const tensor& in, const tensor& y, std::int64_t start,
                       const cache_of& cache, const tensor& logits) {
  const std::int64_t b = in.size(0), n = in.size(1);
  const shape bn{b, n, cfg_.dim};
  tensor x0 = in;
  if (span.front) {
    x0 = x(span.first, bn);
    front_.forward_step(in, start, x0);
  }
  for (std::int64_t i = span.first; i < span.end; ++i)
    blocks_[i]->forward_step(i == span.first ? x0 : x(i, bn),
                             writes_y(span, i, y) ? y : x(i + 1, bn), cache(i), start);
  if (span.back) step_head(b, n, logits);
}

template <tp_family F>
void tp_trunk<F>::step_head(std::int64_t b, std::int64_t n, const tensor& logits) {
  back_.last_logits(x(cfg_.n_layer, {b, n, cfg_.dim}), logits);
}

}  // namespace troupe::models
