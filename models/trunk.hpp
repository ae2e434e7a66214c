// trunk: the residual stream of a decoder-only language model, embed -> blocks -> head, written
// once for every model family and run under a placement.
//
//   x.0 = front(ids, positions)                  unit 0
//   x.<i+1> = block_i(x.<i>), i = 0..n_layer-1   units 1..n_layer
//   loss = back(x.<n_layer>, targets)            unit n_layer + 1
//
// A family (gpt_family in models/gpt.hpp, llama_family in models/llama.hpp) supplies its parts
// (the concept trunk_family below): its block type, its two ends (the front: embeddings and their
// backward; the back: final norm, head, loss and the head's backward), the scope its blocks are
// named under ("h", "layers"), the checks of its config and the config of one block. The trunk
// declares them in one order (the front, then per block its input x.<i> and the block
// "<scope>.<i>", then x.<n_layer> and the back), runs a training step unit by unit (forward_unit /
// backward_unit, with per-block recompute and the hooks of models/block_use.hpp) or whole
// (forward / backward), and decodes with a kv cache (begin_generation / step_logits).
//
// The trunk binds no memory; its placement does. The whole model (gpt, llama) binds every slot
// with a layer_memory; the streamed placement of the memory tiers
// (models/offload/streamed_model.hpp) plans only the activations and scratch and binds a unit's
// parameters right before it runs.
//
// Why a class template over a traits struct rather than a class over a family interface: the
// blocks and ends are plain structs (the tensor-parallel code composes the same blocks) with no
// virtual base, so the trunk calls them directly; the concept states and checks a family's parts
// where the family is declared; and the code is instantiated once per family, in the family's .cpp
// (extern template in its header). The choice between families at run time is made in one place
// (models/families.hpp: with_family) and kept behind the interfaces that need it, causal_lm and
// streamed_model. The tensor-parallel placements (shard, pipeline stage) run the same order of
// parts over the family's tensor-parallel parts: models/parallel/tp_trunk.hpp.
#pragma once

#include <algorithm>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "memory/error.hpp"
#include "models/block_use.hpp"
#include "models/kv_cache.hpp"
#include "models/layers/attention.hpp"
#include "models/layers/slots.hpp"
#include "models/targets.hpp"

namespace troupe::models {

// What a family gives the trunk. The config has the fields vocab, dim, n_layer, max_seq,
// recompute and unbound with gpt_config's meaning. The back reads its own parameters and the
// head weight (head_weight(): the front's token embedding when the head is tied).
template <class F>
concept trunk_family = requires(const typename F::config& c, typename F::block& b,
                                const typename F::block& cb, typename F::ends& e,
                                const typename F::ends& ce, slot_list& s, batch_dims d,
                                const tensor& t, tensor& out, const kv_layer& kv) {
  { F::name } -> std::convertible_to<const char*>;              // for messages: "gpt"
  { F::block_scope } -> std::convertible_to<std::string_view>;  // blocks are "<scope>.<i>"
  { F::checked(c) } -> std::same_as<typename F::config>;        // checked, defaults resolved
  requires std::constructible_from<typename F::block, decltype(F::block_config(c))>;
  requires std::constructible_from<typename F::ends, const typename F::config&>;
  { F::attention_of(cb) } -> std::same_as<const attention&>;  // sizes the kv cache
  { c.vocab + c.dim + c.n_layer + c.max_seq } -> std::convertible_to<std::int64_t>;
  { c.recompute } -> std::convertible_to<bool>;
  { c.unbound } -> std::convertible_to<bool>;
  b.declare(s, std::string_view{}, d, true);
  b.forward(t, t);
  b.recompute(t);
  b.backward(t, t);
  b.forward_step(t, t, kv, std::int64_t{0});
  e.declare_front(s, d);
  e.declare_back(s, d);
  e.embed(t, t, t);  // ids [B, T], positions [T], x.0 [B, T, C]
  { e.head(t, t) } -> std::same_as<double>;
  e.head_backward(1.0, out, out);  // dx, spare
  e.embed_backward(t);
  { e.last_logits(t) } -> std::same_as<tensor>;  // logits of x's last position, [B, V]
  { ce.logits_cur } -> std::convertible_to<tensor>;
  { ce.head_weight() } -> std::same_as<const tensor&>;
};

template <trunk_family F>
class trunk {
 public:
  using config_type = typename F::config;

  // Checks the config and the planned batch and declares every slot; binds none. The positions
  // 0..max_seq-1 (i32) are made on `dev`, unless cfg.unbound.
  trunk(const config_type& cfg, batch_dims dims, dtype t = dtype::f32, device dev = device::cpu());
  trunk(const trunk&) = delete;
  trunk& operator=(const trunk&) = delete;

  const config_type& config() const { return cfg_; }  // as F::checked resolved it
  const slot_list& slots() const { return slots_; }

  // ids, targets: i32 [B, T] on the model's device (B, T at most the planned ones). Returns the
  // mean loss over non-ignored targets and keeps what backward needs; ids and targets must stay
  // intact until backward is done.
  double forward(const tensor& ids, const tensor& targets);
  // Packed rows (several sequences per row: models/post/sft_data.hpp) for the forwards that
  // follow: segments and positions i32 [B, T] on the model's device, like the ids of those
  // forwards, kept intact until their backward. A token attends only to the earlier tokens of
  // its segment; positions restart per sequence (GPT-2's learned positions; RoPE needs none,
  // attention.hpp). Undefined tensors: one sequence per row again.
  void set_packing(const tensor& segments, const tensor& positions);
  // Context parallelism (models/parallel/context_parallel.hpp) for the forwards that follow: the
  // ids are positions position_offset.. of each sample (learned positions read those), and block
  // i's attention exchanges its heads with the other ranks through exchange(i) (attention.hpp;
  // not owned, null: none). Not with set_packing. (0, {}): the whole sequence again.
  void set_context(std::int64_t position_offset,
                   const std::function<sequence_exchange*(std::int64_t block)>& exchange);
  // Context parallelism by ring attention (models/layers/sequence_ring.hpp): the ids are the
  // tokens at `positions` (i32 [T], the planned seq, on the model's device; kept, not copied) of
  // each sample, which learned positions read, and every block's attention runs its core through
  // `ring` (RoPE at ring->pieces()). Null ring and undefined positions: back to a whole sequence.
  void set_ring_context(const tensor& positions, sequence_ring* ring);
  // Weights of the sequences of the batch for the backwards that follow (empty: the mean loss):
  // backward then gives the gradient of loss_scale * sum_b w_b * (the summed losses of row b)
  // (cross_entropy_loss::sequence_weights; preference training).
  void set_sequence_weights(std::vector<double> w) { ends_.loss.sequence_weights = std::move(w); }
  // The gradient of the logits for the backwards that follow, written by f instead of the loss's
  // (cross_entropy_loss::logit_grads; a reward model's score). Empty: the loss's again.
  void set_logit_grads(std::function<void(const tensor&, double)> f) {
    ends_.loss.logit_grads = std::move(f);
  }
  // Logits of the last forward, [B*T, V] (overwritten by backward).
  tensor logits() const { return ends_.logits_cur; }
  // Accumulates d(loss_scale * loss)/d(params) into the gradients; once per forward. With
  // config().recompute, each block but the last runs its forward again first.
  void backward(double loss_scale = 1.0);
  // Called by backward as soon as block i's parameter gradients are final (i = n_layer - 1 down
  // to 0). Empty: not called.
  std::function<void(std::int64_t block)> on_block_grads;
  // Called around every use of block i's parameters in forward and backward
  // (models/block_use.hpp). Empty: not called.
  block_use_hook on_block_use;

  // The same step unit by unit: begin(ids, targets), forward_unit(0..units()-1), then
  // backward_unit(units()-1..0). Unit u reads the parameters unit_params(u) (indices into
  // slots().slots(), in slot order): the front's, block u-1's, or the back's and the head weight.
  std::int32_t units() const { return static_cast<std::int32_t>(unit_params_.size()); }
  const std::vector<std::int32_t>& unit_params(std::int32_t u) const;
  void begin(const tensor& ids, const tensor& targets);
  void forward_unit(std::int32_t u);
  double loss() const { return loss_; }  // after the back's forward
  void backward_unit(std::int32_t u, double loss_scale = 1.0);

  // Incremental decoding with a kv cache. begin_generation plans a cache for `batch` sequences of
  // up to `capacity` positions (0: max_seq) and empties it; step_logits runs new tokens ids
  // [B, t] (i32, B <= batch, t <= the planned seq) at the next positions and returns the logits
  // of the last one, [B, V] (valid until the next call). Steps reuse the training activations:
  // run forward again before backward. The hooks are not called.
  void begin_generation(std::int64_t batch, std::int64_t capacity = 0);
  tensor step_logits(const tensor& ids);
  std::int64_t generated_length() const { return cache_ ? cache_->length() : 0; }

 protected:
  // (protected: the families' init_values read them)
  config_type cfg_;
  slot_list slots_;
  const typename F::ends& ends() const { return ends_; }  // a family's statistics (moe)

 private:
  tensor x(std::int64_t i, std::int64_t b, std::int64_t t) const;

  batch_dims dims_;
  typename F::ends ends_;
  std::vector<typename F::block> blocks_;
  std::vector<tensor> x_;  // the residual stream: x_[i] is the input of block i; [B, T, C]
  owned_tensor positions_;
  std::vector<std::vector<std::int32_t>> unit_params_;
  tensor ids_, targets_;
  tensor segments_, row_positions_;   // set_packing's
  std::int64_t position_offset_ = 0;  // set_context's
  tensor context_positions_;          // set_ring_context's
  tensor da_, db_;                    // backward: db_ holds d(the current unit's output)
  std::int64_t b_ = 0, t_ = 0;
  double loss_ = 0;
  std::unique_ptr<kv_cache> cache_;
  dtype dtype_;
  device dev_;
};

// ---- definitions (instantiated in the families' .cpp files) -------------------------------------

template <trunk_family F>
trunk<F>::trunk(const config_type& cfg, batch_dims dims, dtype t, device dev)
    : cfg_(F::checked(cfg)), dims_(dims), ends_(cfg_), dtype_(t), dev_(dev) {
  TROUPE_CHECK(dims.batch > 0 && dims.seq > 0, F::name, ": the planned batch [", dims.batch, ", ",
               dims.seq, "] must be positive");
  TROUPE_CHECK(dims.seq <= cfg_.max_seq, F::name, ": sequence length ", dims.seq,
               " exceeds max_seq ", cfg_.max_seq);
  const std::int64_t n = cfg_.n_layer;
  blocks_.reserve(static_cast<std::size_t>(n));  // the slots point into the blocks: no moves
  for (std::int64_t i = 0; i < n; ++i) blocks_.emplace_back(F::block_config(cfg_));
  // A family whose ends read its blocks (the MoE family's aux loss) connects them here.
  if constexpr (requires { F::connect(ends_, blocks_); }) F::connect(ends_, blocks_);
  x_.resize(static_cast<std::size_t>(n) + 1);

  // unit_end[u]: the slots declared up to unit u's.
  std::vector<std::size_t> unit_end;
  shape bt{dims.batch, dims.seq, cfg_.dim};
  ends_.declare_front(slots_, dims);
  unit_end.push_back(slots_.slots().size());
  for (std::int64_t i = 0; i < n; ++i) {
    slots_.activation("x." + std::to_string(i), bt, x_[i]);
    const auto mark = slots_.mark_block(i);
    blocks_[i].declare(slots_, std::string(F::block_scope) + "." + std::to_string(i), dims,
                       cfg_.recompute);
    unit_end.push_back(slots_.slots().size());
  }
  slots_.activation("x." + std::to_string(n), bt, x_[n]);
  ends_.declare_back(slots_, dims);
  unit_end.push_back(slots_.slots().size());

  const auto& all = slots_.slots();
  unit_params_.resize(unit_end.size());
  for (std::size_t u = 0, i = 0; u < unit_end.size(); ++u)
    for (; i < unit_end[u]; ++i)
      if (all[i].kind == slot_kind::param) unit_params_[u].push_back(static_cast<std::int32_t>(i));
  auto& back = unit_params_.back();
  for (std::size_t i = 0; i < all.size(); ++i)
    if (all[i].field == &ends_.head_weight() &&
        std::find(back.begin(), back.end(), static_cast<std::int32_t>(i)) == back.end())
      back.insert(std::upper_bound(back.begin(), back.end(), static_cast<std::int32_t>(i)),
                  static_cast<std::int32_t>(i));

  if (cfg_.unbound) return;
  owned_tensor pos = empty(shape{cfg_.max_seq}, dtype::i32);
  for (std::int64_t i = 0; i < cfg_.max_seq; ++i)
    pos.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(i);
  positions_ = dev.is_cpu() ? std::move(pos) : to_device(pos, dev);
}

template <trunk_family F>
tensor trunk<F>::x(std::int64_t i, std::int64_t b, std::int64_t t) const {
  return planned_view(x_[static_cast<std::size_t>(i)], {b, t, cfg_.dim}, F::name, "x");
}

template <trunk_family F>
const std::vector<std::int32_t>& trunk<F>::unit_params(std::int32_t u) const {
  TROUPE_CHECK(u >= 0 && u < units(), F::name, ": no unit ", u, " (", units(), " units)");
  return unit_params_[static_cast<std::size_t>(u)];
}

template <trunk_family F>
double trunk<F>::forward(const tensor& ids, const tensor& targets) {
  begin(ids, targets);
  for (std::int32_t u = 0; u < units(); ++u) forward_unit(u);
  return loss_;
}

template <trunk_family F>
void trunk<F>::backward(double loss_scale) {
  TROUPE_CHECK(b_ > 0, F::name, ": backward called before forward");
  for (std::int32_t u = units() - 1; u >= 0; --u) backward_unit(u, loss_scale);
}

template <trunk_family F>
void trunk<F>::set_packing(const tensor& segments, const tensor& positions) {
  TROUPE_CHECK(segments.defined() == positions.defined(), F::name,
               ": packed rows need both segments and positions, or neither");
  segments_ = segments;
  row_positions_ = positions;
  // The blocks are this trunk's own (non-const) objects; attention_of gives const access for the
  // kv cache's sizes, and the segments are the one per-batch input the attention takes.
  for (auto& blk : blocks_) const_cast<attention&>(F::attention_of(blk)).segments = segments;
}

template <trunk_family F>
void trunk<F>::set_context(std::int64_t position_offset,
                           const std::function<sequence_exchange*(std::int64_t block)>& exchange) {
  TROUPE_CHECK(position_offset >= 0 && position_offset + dims_.seq <= cfg_.max_seq, F::name,
               ": context position offset ", position_offset, " + the planned seq ", dims_.seq,
               " exceeds max_seq ", cfg_.max_seq);
  position_offset_ = position_offset;
  for (std::size_t i = 0; i < blocks_.size(); ++i)
    const_cast<attention&>(F::attention_of(blocks_[i])).exchange =
        exchange ? exchange(static_cast<std::int64_t>(i)) : nullptr;
}

template <trunk_family F>
void trunk<F>::set_ring_context(const tensor& positions, sequence_ring* ring) {
  TROUPE_CHECK(positions.defined() == (ring != nullptr), F::name,
               ": ring context parallelism needs both positions and a ring, or neither");
  TROUPE_CHECK(!positions.defined() ||
                   (positions.type() == dtype::i32 && positions.sizes() == shape({dims_.seq})),
               F::name, ": ring context positions must be i32 [", dims_.seq, "], got ",
               describe(positions));
  context_positions_ = positions;
  for (auto& blk : blocks_) const_cast<attention&>(F::attention_of(blk)).ring = ring;
}

template <trunk_family F>
void trunk<F>::begin(const tensor& ids, const tensor& targets) {
  const batch_dims got = checked_batch(ids, targets, dims_, F::name);
  TROUPE_CHECK(!segments_.defined() || (position_offset_ == 0 && !context_positions_.defined()),
               F::name, ": packed rows cannot be split over context-parallel ranks");
  TROUPE_CHECK(!context_positions_.defined() || got.seq == dims_.seq, F::name,
               ": under ring context parallelism every batch holds the planned ", dims_.seq,
               " tokens of each sample, got ", got.seq);
  if (segments_.defined())
    for (const tensor* p : {&segments_, &row_positions_})
      TROUPE_CHECK(p->type() == dtype::i32 && p->sizes() == ids.sizes(), F::name,
                   ": packed segments and positions must be i32 like the ids ", ids.sizes().str(),
                   ", got ", describe(*p));
  b_ = got.batch;
  t_ = got.seq;
  ids_ = ids;
  targets_ = targets;
}

template <trunk_family F>
void trunk<F>::forward_unit(std::int32_t u) {
  const std::int64_t n = cfg_.n_layer;
  if (u == 0) {
    ends_.embed(ids_,
                row_positions_.defined()       ? row_positions_
                : context_positions_.defined() ? context_positions_.narrow(0, 0, t_)
                                               : positions_.narrow(0, position_offset_, t_),
                x(0, b_, t_));
  } else if (u <= n) {
    const std::int64_t i = u - 1;
    notify(on_block_use, i, block_use::before_forward);
    blocks_[i].forward(x(i, b_, t_), x(i + 1, b_, t_));
    notify(on_block_use, i, block_use::after_forward);
  } else {
    loss_ = ends_.head(x(n, b_, t_), targets_);
  }
}

template <trunk_family F>
void trunk<F>::backward_unit(std::int32_t u, double loss_scale) {
  const std::int64_t n = cfg_.n_layer;
  if (u == n + 1) {
    ends_.head_backward(loss_scale, db_, da_);
  } else if (u >= 1) {
    const std::int64_t i = u - 1;
    notify(on_block_use, i, block_use::before_backward);
    // The last block's activations are still those of the forward.
    if (cfg_.recompute && i + 1 < n) blocks_[i].recompute(x(i, b_, t_));
    blocks_[i].backward(db_, da_);
    if (on_block_grads) on_block_grads(i);
    notify(on_block_use, i, block_use::after_backward);
    std::swap(da_, db_);
  } else {
    ends_.embed_backward(db_);  // db_ holds d(x.0) now
  }
}

template <trunk_family F>
void trunk<F>::begin_generation(std::int64_t batch, std::int64_t capacity) {
  if (capacity == 0) capacity = cfg_.max_seq;
  TROUPE_CHECK(batch > 0 && batch <= dims_.batch, F::name, ": generation batch ", batch,
               " must be in 1..", dims_.batch, " (the planned batch)");
  TROUPE_CHECK(capacity > 0 && capacity <= cfg_.max_seq, F::name, ": generation capacity ",
               capacity, " must be in 1..", cfg_.max_seq, " (max_seq)");
  if (cache_ && cache_->dims().batch == batch && cache_->dims().capacity == capacity) {
    cache_->clear();
    return;
  }
  const auto& a = F::attention_of(blocks_[0]).cfg;
  const kv_cache_dims d{
      .batch = batch, .capacity = capacity, .n_kv_head = a.n_kv_head, .head_dim = a.head_dim};
  cache_.reset();  // free the old cache before planning the new one
  cache_ = std::make_unique<kv_cache>(cfg_.n_layer, d, dtype_, dev_);
}

template <trunk_family F>
tensor trunk<F>::step_logits(const tensor& ids) {
  TROUPE_CHECK(cache_ != nullptr, F::name, ": step_logits called before begin_generation");
  TROUPE_CHECK(ids.defined() && ids.dim() == 2 && ids.type() == dtype::i32, F::name,
               ": ids must be i32 [B, t], got ", describe(ids));
  const std::int64_t b = ids.size(0), t = ids.size(1), start = cache_->length();
  TROUPE_CHECK(b <= cache_->dims().batch && t <= dims_.seq, F::name, ": step [", b, ", ", t,
               "] exceeds the generation batch ", cache_->dims().batch, " or the planned seq ",
               dims_.seq);
  cache_->check_room(t, F::name);
  ends_.embed(ids, positions_.narrow(0, start, t), x(0, b, t));
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i)
    blocks_[i].forward_step(x(i, b, t), x(i + 1, b, t), cache_->layer(i), start);
  tensor out = ends_.last_logits(x(cfg_.n_layer, b, t));
  cache_->advance(t);
  return out;
}

}  // namespace troupe::models
