// tp_model: a family's tensor shard, the tp_trunk (tp_trunk.hpp) over every block with both ends,
// in one layer_memory, with the whole model's training and generation interface (causal_lm_of
// drives it through the trainer and generate()). tp_gpt and tp_llama are its GPT-2 and Llama
// (parallelize_gpt.hpp, parallelize_llama.hpp).
//
// Parameters keep the whole model's names and order; a shard's parameter is the whole one or its
// slice as its declaration says (param_spec, param_slices.hpp), so load_from takes the shard's
// part of an unsharded model by name and init_weights slices the whole model's init stream. With
// cfg.recompute the blocks' activations share one set of bytes (slots.hpp) and backward runs each
// block's forward (but the last's, still in those bytes) again first, between the block's
// before_backward and after_backward (all shards together: the recomputed forward holds the same
// collectives). Generation (tp_generation.hpp): every shard runs a step's new positions whole,
// also with SP (a prompt longer than the shard's rows runs as several cached passes), its
// attention over a kv cache of its heads, and the head's vocabulary columns of the last position
// are gathered into the full [B, V] on every shard. Host (CPU); trains in f32 or bf16 (the memory's
// dtype; bf16 under mixed_piece.hpp with f32 master weights), generates in f32 only.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "models/block_use.hpp"
#include "models/parallel/param_slices.hpp"
#include "models/parallel/tp_generation.hpp"
#include "models/parallel/tp_trunk.hpp"

namespace troupe::models {

template <tp_family F>
class tp_model {
 public:
  using config_type = typename F::config;

  // t: the dtype of the shard's parameters, gradients and activations (f32, bf16 or f16).
  tp_model(const config_type& cfg, batch_dims dims, tp_group tp, dtype t = dtype::f32);
  tp_model(const tp_model&) = delete;
  tp_model& operator=(const tp_model&) = delete;

  const config_type& config() const { return trunk_.config(); }  // checked, defaults resolved
  const slot_list& slots() const { return slots_; }
  layer_memory& memory() { return mem_; }
  const tp_group& group() const { return tp_; }

  // The shard's part of `full`'s parameters (from_grads: of its gradients, written into this
  // model's gradients with to_grads), matched by name.
  void load_from(const slot_list& full, bool from_grads = false, bool to_grads = false);
  void load_from(const trunk<F>& full) { load_from(full.slots()); }
  // The weights of the whole model's init_weights(seed), sliced.
  void init_weights(std::uint64_t seed);

  // ids, targets: i32 [B, T] on the host, the same on every shard. Returns the mean loss.
  double forward(const tensor& ids, const tensor& targets);
  tensor logits() const { return trunk_.back().logits(); }  // the shard's columns [B*T, V/tp]
  void backward(double loss_scale = 1.0);
  // Packed rows for the forwards and backwards that follow (trunk::set_packing: segments and
  // positions i32 [B, T] on the host like the ids, the same on every shard, kept intact until
  // those backwards; undefined: one sequence per row).
  void set_packing(const tensor& segments, const tensor& positions) {
    trunk_.set_packing(all(), segments, positions);
    segments_ = segments;
    positions_ = positions;
  }
  // A per-token objective for the forwards and backwards that follow (tp_head::objective).
  void set_token_objective(token_objective f) { trunk_.back().objective = std::move(f); }
  // Called around every use of block i's parameters (models/block_use.hpp). Empty: not called.
  block_use_hook on_block_use;

  // Incremental decoding as the whole model's, all shards together: begin_generation plans the
  // shard's kv cache for `batch` sequences of up to `capacity` positions (0: max_seq); step_logits
  // runs new tokens ids [B, t] (i32 on the host, the same on every shard, t <= the planned seq)
  // and returns the logits of the last one, [B, V] on every shard (valid until the next call).
  // Steps reuse the training activations: run forward again before backward.
  void begin_generation(std::int64_t batch, std::int64_t capacity = 0);
  tensor step_logits(const tensor& ids);
  std::int64_t generated_length() const { return gen_ ? gen_->length() : 0; }

 private:
  block_span all() const { return {0, config().n_layer, true, true}; }

  tp_group tp_;
  batch_dims dims_;
  tp_trunk<F> trunk_;
  slot_list slots_;
  layer_memory mem_;
  batch_dims last_{0, 0};        // the batch of the last forward
  tensor segments_, positions_;  // set_packing's (not owned)
  std::unique_ptr<tp_generation> gen_;
};

// ---- definitions (instantiated with the families' tp parts) ------------------------------------

template <tp_family F>
tp_model<F>::tp_model(const config_type& cfg, batch_dims dims, tp_group tp, dtype t)
    : tp_(tp), dims_(dims), trunk_(cfg, dims, tp, std::string("tp_") + F::name) {
  TROUPE_CHECK(t == dtype::f32 || t == dtype::bf16 || t == dtype::f16, trunk_.who(),
               ": a tensor shard computes in f32, bf16 or f16, not ", dtype_name(t));
  trunk_.declare(slots_, all(), config().recompute);
  trunk_.declare_scratch(slots_);
  mem_ = layer_memory(slots_, t, device::cpu());
  trunk_.bind_tied_head();
}

template <tp_family F>
void tp_model<F>::load_from(const slot_list& full, bool from_grads, bool to_grads) {
  copy_slices_by_name(slots_, full, from_grads, to_grads, /*into_piece=*/true, tp_, trunk_.who());
}

template <tp_family F>
void tp_model<F>::init_weights(std::uint64_t seed) {
  config_type whole = config();
  whole.unbound = true;
  const typename F::model full(whole, {1, 1});
  init_slices([&](const init_sink& each) { full.init_values(seed, each); }, slots_, tp_,
              trunk_.who());
}

template <tp_family F>
double tp_model<F>::forward(const tensor& ids, const tensor& targets) {
  last_ = checked_batch(ids, targets, dims_, trunk_.who());
  if (segments_.defined())
    for (const tensor* p : {&segments_, &positions_})
      TROUPE_CHECK(p->type() == dtype::i32 && p->sizes() == ids.sizes(), trunk_.who(),
                   ": packed segments and positions must be i32 like the ids ", ids.sizes().str(),
                   ", got ", describe(*p));
  return trunk_.forward(all(), last_, ids, targets, tensor{}, on_block_use);
}

template <tp_family F>
void tp_model<F>::backward(double loss_scale) {
  TROUPE_CHECK(last_.batch > 0, trunk_.who(), ": backward called before forward");
  trunk_.backward(all(), last_, loss_scale, tensor{}, tensor{}, config().recompute, on_block_use);
}

template <tp_family F>
void tp_model<F>::begin_generation(std::int64_t batch, std::int64_t capacity) {
  TROUPE_CHECK(mem_.params().type() == dtype::f32, trunk_.who(),
               ": generation from a tensor shard runs in f32 only, this shard computes in ",
               dtype_name(mem_.params().type()));
  const auto& a = trunk_.attention_of().cfg;  // the shard's heads
  begin_tp_generation(gen_,
                      {.n_layer = config().n_layer,
                       .batch = batch,
                       .capacity = capacity,
                       .n_kv_head = a.n_kv_head,
                       .head_dim = a.head_dim,
                       .vocab = config().vocab,
                       .rows = trunk_.rows()[1],
                       .max_batch = dims_.batch,
                       .max_step = dims_.seq,
                       .max_seq = config().max_seq},
                      tp_, trunk_.who());
}

template <tp_family F>
tensor tp_model<F>::step_logits(const tensor& ids) {
  TROUPE_CHECK(gen_ != nullptr, trunk_.who(), ": step_logits called before begin_generation");
  const std::int64_t b = ids.dim() == 2 ? ids.size(0) : 0;
  const auto cache = [&](std::int64_t i) -> const kv_layer& { return gen_->layer(i); };
  block_span blocks = all();
  blocks.back = false;  // the head once, on the last pass's last position
  const std::int64_t n = gen_->run(ids, trunk_.who(), [&](const tensor& part, std::int64_t start) {
    trunk_.step(blocks, part, tensor{}, start, cache, tensor{});
  });
  trunk_.step_head(b, n, gen_->local_logits(b));
  return gen_->gather(b);
}

}  // namespace troupe::models
