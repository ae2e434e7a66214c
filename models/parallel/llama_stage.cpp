// llama_stage: a Llama pipeline stage (see llama_stage.hpp).
#include "models/parallel/llama_stage.hpp"

#include <string>

#include "memory/error.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/tp_compose.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

namespace {

// The stage's boundary [B, T_local, C] (T_local = T / tp with SP), after the config's checks.
shape llama_boundary(const llama_config& cfg, batch_dims dims, const tp_group& tp) {
  const llama_config c = resolve_tp_llama_config(cfg, tp, "llama_stage");
  TROUPE_CHECK(dims.seq <= c.max_seq, "llama_stage: sequence length ", dims.seq,
               " exceeds max_seq (max_position_embeddings) ", c.max_seq);
  return shard_rows(dims, c.dim, tp, "llama_stage");
}

}  // namespace

llama_stage::llama_stage(const llama_config& cfg_in, batch_dims dims, const stage_options& o,
                         tp_group tp)
    : pipeline_stage("llama_stage", cfg_in.n_layer, dims, o, tp, llama_boundary(cfg_in, dims, tp)),
      cfg_(resolve_tp_llama_config(cfg_in, tp, "llama_stage")),
      embed_tokens_({.vocab = cfg_.vocab, .dim = cfg_.dim}, tp),
      head_(cfg_, tp) {
  first_ = holds_first(0);
  last_ = holds_last(chunks() - 1);
  h_.resize(static_cast<std::size_t>(cfg_.n_layer));
  x_.resize(static_cast<std::size_t>(cfg_.n_layer + 1));
  const shape bt = boundary();
  for (int c = 0; c < chunks(); ++c) {
    open_chunk(c);
    if (holds_first(c)) embed_tokens_.declare(slots_, "embed_tokens", dims);
    for (std::int64_t i = first_block(c); i < end_block(c); ++i) {
      h_[i] = std::make_unique<tp_llama_block>(cfg_, tp);
      slots_.activation("x." + std::to_string(i), bt, x_[i]);
      h_[i]->declare(slots_, "layers." + std::to_string(i), dims);
    }
    if (holds_last(c)) {
      slots_.activation("x." + std::to_string(cfg_.n_layer), bt, x_[cfg_.n_layer]);
      // Tied: the head is embed_tokens' (stage 0 also) or the stage's own copy of it.
      head_.declare(slots_, dims,
                    !cfg_.tie_embeddings ? "lm_head" : (first_ ? "" : "embed_tokens"));
    }
    close_chunk(c);
  }
  slots_.scratch("dx_a", bt, dx_a_);
  slots_.scratch("dx_b", bt, dx_b_);
  set_recompute(cfg_.recompute);  // the stage recomputes as a whole, not block by block
  plan_memory();
  if (last_ && first_ && cfg_.tie_embeddings) {
    head_.weight = embed_tokens_.weight;
    head_.dweight = embed_tokens_.dweight;
  }
  if (cfg_.tie_embeddings && stages() > 1 && (first_ || last_))
    set_tied("embed_tokens.weight", first_ ? embed_tokens_.dweight : head_.dweight);
}

void llama_stage::load_from(const slot_list& full, bool from_grads, bool to_grads) {
  copy_slices_by_name(slots_, full, from_grads, to_grads, /*into_piece=*/true, tp(), "llama_stage");
}

void llama_stage::store_to(const slot_list& full, bool from_grads, bool to_grads) const {
  copy_slices_by_name(slots_, full, to_grads, from_grads, /*into_piece=*/false, tp(),
                      "llama_stage");
}

void llama_stage::init_weights(std::uint64_t seed) {
  llama_config whole = cfg_;
  whole.unbound = true;
  const llama full(whole, {1, 1});
  init_slices([&](const init_sink& each) { full.init_values(seed, each); }, slots_, tp(),
              "llama_stage");
}

bool llama_stage::replicated_over_tp(std::string_view p) const {
  for (std::string_view sharded :
       {"embed_tokens.weight", "lm_head.weight", "_proj.weight", "q_proj.bias", "k_proj.bias",
        "v_proj.bias", "gate_proj.bias", "up_proj.bias"})
    if (p.ends_with(sharded)) return false;
  return true;  // the RMSNorms and the row-parallel biases (o_proj's, down_proj's)
}

double llama_stage::run_forward(int c, const tensor& in, const tensor& targets, const tensor& y) {
  const std::int64_t a = first_block(c), b = end_block(c);
  if (holds_first(c))
    embed_tokens_.forward(in, x_[a]);
  else
    ops::copy(in, x_[a]);
  for (std::int64_t i = a; i < b; ++i)
    h_[i]->forward(x_[i], i + 1 == b && !holds_last(c) ? y : x_[i + 1]);
  if (!holds_last(c)) return 0.0;
  return head_.forward(x_[cfg_.n_layer], targets);
}

void llama_stage::run_backward(int c, const tensor& dy, const tensor& dx, double weight,
                               const block_hook& after_block) {
  const std::int64_t a = first_block(c), b = end_block(c);
  const tensor& da = dx_a_;
  const tensor& db = dx_b_;
  tensor g = dy;
  if (holds_last(c)) {
    head_.backward(weight, da, db);
    g = db;
  }
  for (std::int64_t i = b - 1; i >= a; --i) {
    tensor out = i == a && !holds_first(c) ? dx : (g.data() == da.data() ? db : da);
    h_[i]->backward(g, out);
    if (after_block) after_block(i);
    g = out;
  }
  if (holds_first(c)) embed_tokens_.backward(g);
}

void llama_stage::save_extra(int c, std::size_t slot) {
  if (holds_first(c)) {
    if (embed_saved_.size() <= slot) embed_saved_.resize(slot + 1);
    embed_saved_[slot] = embed_tokens_;
  }
  if (holds_last(c)) {
    if (count_saved_.size() <= slot) count_saved_.resize(slot + 1);
    count_saved_[slot] = head_.loss.count;
  }
}

void llama_stage::restore_extra(int c, std::size_t slot) {
  if (holds_first(c)) embed_tokens_ = embed_saved_[slot];
  if (holds_last(c)) head_.loss.count = count_saved_[slot];
}

}  // namespace troupe::models::parallel
