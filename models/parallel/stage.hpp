// stage: one pipeline rank's part of a model of family F, the tp_trunk (tp_trunk.hpp) over the
// spans of its chunks, on the pipeline_stage base (pipeline_stage.hpp: the chunks, the memory, the
// activation stash, recompute, split backwards). gpt_stage and llama_stage are its GPT-2 and Llama
// (gpt_stage.hpp, llama_stage.hpp).
//
//   virtual stage 0:     the family's front (its token embedding vocab parallel)
//   every chunk:         its blocks <scope>.<first_block(c)> .. <scope>.<end_block(c) - 1>
//   last virtual stage:  the back (tp_head.hpp: final norm, head on the shard's vocabulary rows,
//                        vocab-parallel cross-entropy). With a tied head the last stage, when it
//                        is not stage 0, holds its own copy of the token embedding under the same
//                        name; the runner sums its gradient with stage 0's.
//
// Built on the tensor-parallel parts, a stage may also be a tensor shard (tp x pp, with or without
// SP); with tp_group{} the parts are the unsharded ones. Parameter names and slicing are the tensor
// shard's (tp_model.hpp). cfg.recompute: stashes keep the stage input only and a restored
// microbatch's chunk runs forward again before its backward (the stage, not the block, is the
// recomputed unit). Generation (step_chunk, pipeline_generation.hpp): the same spans, each block
// over its kv cache, the head on the last position.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "models/parallel/param_slices.hpp"
#include "models/parallel/pipeline_stage.hpp"
#include "models/parallel/tp_trunk.hpp"

namespace troupe::models::parallel {

// What travels with a family's activations between virtual stages besides the residual stream:
// nothing here; the MoE family's router statistics (moe_stage.hpp: its aux loss reads every
// layer's) in its specialisation. The boundary is boundary(rows) (rows: the residual stream's
// shape); rows_of(t) views the residual stream in a boundary tensor t; forward (after a chunk's
// forward: in is the received boundary, undefined on virtual stage 0; y the boundary sent on,
// undefined on the last) returns what it adds to the loss; backward runs before a chunk's backward
// (dy undefined on the last virtual stage, dx on the first); save and restore keep its state per
// stash buffer.
template <class F>
struct stage_side {
  stage_side(const typename F::config&, int) {}
  static shape boundary(const shape& rows, dtype, const std::string&) { return rows; }
  static tensor rows_of(const tensor& t) { return t; }
  double forward(tp_trunk<F>&, block_span, int, const tensor&, const tensor&) { return 0; }
  void backward(tp_trunk<F>&, block_span, int, const tensor&, const tensor&, double) {}
  void save(tp_trunk<F>&, block_span, int, std::size_t) {}
  void restore(tp_trunk<F>&, block_span, int, std::size_t) {}
};

template <tp_family F>
class stage final : public pipeline_stage {
 public:
  using config_type = typename F::config;

  // dims: the microbatch [rows, seq] every forward runs on.
  stage(const config_type& cfg, batch_dims dims, const stage_options& o, tp_group tp = {});

  const config_type& config() const { return trunk_.config(); }  // checked, defaults resolved
  tp_trunk<F>& parts() { return trunk_; }  // the family's parts of the held chunks

  void load_from(const slot_list& full, bool from_grads = false, bool to_grads = false) override;
  void load_from(const trunk<F>& full) { load_from(full.slots()); }
  void store_to(const slot_list& full, bool from_grads = false,
                bool to_grads = false) const override;
  void init_weights(std::uint64_t seed) override;
  void step_chunk(int chunk, const tensor& in, const tensor& y, std::int64_t start) override;
  // Context parallelism (tp_group{} only): every held block's attention and the front's positions.
  void set_context(const stage_context& c) override {
    trunk_.set_context(c.positions, c.exchange, c.ring);
    keep_ = c.keep;
  }

 private:
  static std::string who() { return std::string(F::name) + "_stage"; }
  // The boundary [B, T_local, C] after the config's checks (before the base is built).
  static shape boundary_of(const config_type& cfg, batch_dims dims, const tp_group& tp, dtype type);
  block_span span_of(int c) const {
    return {first_block(c), end_block(c), holds_first(c), holds_last(c)};
  }
  double run_forward(int chunk, const tensor& in, const tensor& targets, const tensor& y) override;
  void run_backward(int chunk, const tensor& dy, const tensor& dx, double weight,
                    const block_hook& after_block) override;
  bool use_packing(int c, const tensor& segments, const tensor& positions) override {
    trunk_.set_packing(span_of(c), segments, positions);
    return true;
  }
  bool use_objective(token_objective f) override {
    trunk_.back().objective = std::move(f);
    return true;
  }
  void save_extra(int chunk, std::size_t slot) override;
  void restore_extra(int chunk, std::size_t slot) override;

  tp_trunk<F> trunk_;
  stage_side<F> side_;
  // Per stash buffer: the token embedding's state (its ids' local rows) and the loss's count.
  std::vector<vocab_parallel_embedding> tokens_saved_;
  std::vector<std::int64_t> count_saved_;
  // and its per-token objective with the row weights it gave (tp_head::objective).
  std::vector<token_objective> objective_saved_;
  std::vector<std::vector<double>> row_weights_saved_;
  std::function<void(std::int64_t, std::size_t, bool)> keep_;  // set_context's
};

// ---- definitions (instantiated with the families' tp parts) ------------------------------------

template <tp_family F>
shape stage<F>::boundary_of(const config_type& cfg, batch_dims dims, const tp_group& tp,
                            dtype type) {
  const config_type c = tp_parts<F>::checked(cfg, tp, who());
  TROUPE_CHECK(dims.seq <= c.max_seq, who(), ": sequence length ", dims.seq, " exceeds max_seq ",
               c.max_seq);
  return stage_side<F>::boundary(shard_rows(dims, c.dim, tp, who()), type, who());
}

template <tp_family F>
stage<F>::stage(const config_type& cfg, batch_dims dims, const stage_options& o, tp_group tp)
    : pipeline_stage(who(), cfg.n_layer, dims, o, tp, boundary_of(cfg, dims, tp, o.type)),
      trunk_(cfg, dims, tp, who()),
      side_(trunk_.config(), chunks()) {
  for (int c = 0; c < chunks(); ++c) {
    open_chunk(c);
    trunk_.declare(slots_, span_of(c), /*recompute=*/false);
    close_chunk(c);
  }
  trunk_.declare_scratch(slots_);
  set_recompute(config().recompute);
  plan_memory();
  trunk_.bind_tied_head();
  if (stages() > 1 && !trunk_.tied_name().empty()) set_tied(trunk_.tied_name(), trunk_.tied_grad());
  const auto& a = trunk_.attention_of().cfg;  // the shard's heads
  set_generation_shape(a.n_kv_head, a.head_dim, config().vocab, config().max_seq);
}

template <tp_family F>
void stage<F>::load_from(const slot_list& full, bool from_grads, bool to_grads) {
  copy_slices_by_name(slots_, full, from_grads, to_grads, /*into_piece=*/true, tp(), who());
}

template <tp_family F>
void stage<F>::store_to(const slot_list& full, bool from_grads, bool to_grads) const {
  copy_slices_by_name(slots_, full, to_grads, from_grads, /*into_piece=*/false, tp(), who());
}

template <tp_family F>
void stage<F>::init_weights(std::uint64_t seed) {
  config_type whole = config();
  whole.unbound = true;
  const typename F::model full(whole, {1, 1});
  init_slices([&](const init_sink& each) { full.init_values(seed, each); }, slots_, tp(), who());
}

template <tp_family F>
double stage<F>::run_forward(int c, const tensor& in, const tensor& targets, const tensor& y) {
  const tensor received = holds_first(c) ? tensor{} : in;
  const tensor sent = holds_last(c) ? tensor{} : y;
  const double loss =
      trunk_.forward(span_of(c), dims(), received.defined() ? side_.rows_of(in) : in, targets,
                     sent.defined() ? side_.rows_of(y) : y);
  return loss + side_.forward(trunk_, span_of(c), c, received, sent);
}

template <tp_family F>
void stage<F>::run_backward(int c, const tensor& dy, const tensor& dx, double weight,
                            const block_hook& after_block) {
  const tensor received = holds_last(c) ? tensor{} : dy;
  const tensor sent = holds_first(c) ? tensor{} : dx;
  side_.backward(trunk_, span_of(c), c, received, sent, weight);
  trunk_.backward(span_of(c), dims(), weight, received.defined() ? side_.rows_of(dy) : dy,
                  sent.defined() ? side_.rows_of(dx) : dx, /*recompute=*/false, {}, after_block);
}

template <tp_family F>
void stage<F>::step_chunk(int c, const tensor& in, const tensor& y, std::int64_t start) {
  const auto cache = [&](std::int64_t i) -> const kv_layer& { return cached(i); };
  trunk_.step(span_of(c), in, y, start, cache,
              holds_last(c) ? generation().local_logits(in.size(0)) : tensor{});
}

template <tp_family F>
void stage<F>::save_extra(int c, std::size_t slot) {
  side_.save(trunk_, span_of(c), c, slot);
  if (keep_)
    for (std::int64_t i = first_block(c); i < end_block(c); ++i) keep_(i, slot, true);
  if (holds_first(c)) {
    if (tokens_saved_.size() <= slot) tokens_saved_.resize(slot + 1);
    tokens_saved_[slot] = trunk_.front().tokens();
  }
  if (holds_last(c)) {
    if (count_saved_.size() <= slot) count_saved_.resize(slot + 1);
    count_saved_[slot] = trunk_.back().loss.count;
    if (objective_saved_.size() <= slot) objective_saved_.resize(slot + 1);
    if (row_weights_saved_.size() <= slot) row_weights_saved_.resize(slot + 1);
    objective_saved_[slot] = trunk_.back().objective;
    row_weights_saved_[slot] = trunk_.back().loss.row_weights;
  }
}

template <tp_family F>
void stage<F>::restore_extra(int c, std::size_t slot) {
  side_.restore(trunk_, span_of(c), c, slot);
  if (keep_)
    for (std::int64_t i = first_block(c); i < end_block(c); ++i) keep_(i, slot, false);
  if (holds_first(c)) trunk_.front().tokens() = tokens_saved_[slot];
  if (holds_last(c)) {
    trunk_.back().loss.count = count_saved_[slot];
    trunk_.back().objective = objective_saved_[slot];
    trunk_.back().loss.row_weights = row_weights_saved_[slot];
  }
}

}  // namespace troupe::models::parallel
