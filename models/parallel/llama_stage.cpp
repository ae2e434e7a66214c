// llama_stage: a Llama pipeline stage (see llama_stage.hpp).
#include "models/parallel/llama_stage.hpp"

#include <map>
#include <string>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

namespace {

// llama_config with n_kv_head and head_dim resolved as llama does, and the stage's own checks.
llama_config resolved(llama_config c, tp_group tp) {
  TROUPE_CHECK(tp.size() == 1 && !tp.sequence_parallel,
               "llama_stage: tensor parallelism (tp = ", tp.size(),
               (tp.sequence_parallel ? ", sp" : ""),
               ") is not supported for Llama pipeline stages; build them with tp 1");
  TROUPE_CHECK(!c.recompute, "llama_stage: activation recompute is not supported yet");
  TROUPE_CHECK(c.n_layer > 0 && c.n_head > 0 && c.dim > 0,
               "llama_stage: n_layer, n_head and dim must be > 0");
  if (c.n_kv_head == 0) c.n_kv_head = c.n_head;
  if (c.head_dim == 0) {
    TROUPE_CHECK(c.dim % c.n_head == 0, "llama_stage: dim (", c.dim,
                 ") must be a multiple of n_head (", c.n_head, ")");
    c.head_dim = c.dim / c.n_head;
  }
  TROUPE_CHECK(c.n_head % c.n_kv_head == 0, "llama_stage: n_head (", c.n_head,
               ") must be a multiple of n_kv_head (", c.n_kv_head, ")");
  return c;
}

}  // namespace

llama_stage::llama_stage(const llama_config& cfg_in, batch_dims dims, const stage_options& o,
                         tp_group tp)
    : pipeline_stage("llama_stage", cfg_in.n_layer, dims, o, tp,
                     {dims.batch, dims.seq, cfg_in.dim}),
      cfg_(resolved(cfg_in, tp)),
      embed_tokens_({.vocab = cfg_.vocab, .dim = cfg_.dim}),
      norm_({.dim = cfg_.dim, .eps = cfg_.rms_eps}),
      lm_head_({.in = cfg_.dim, .out = cfg_.vocab, .bias = false}) {
  TROUPE_CHECK(dims.seq <= cfg_.max_seq, "llama_stage: sequence length ", dims.seq,
               " exceeds max_seq (max_position_embeddings) ", cfg_.max_seq);
  first_ = holds_first(0);
  last_ = holds_last(chunks() - 1);
  h_.resize(static_cast<std::size_t>(cfg_.n_layer));
  x_.resize(static_cast<std::size_t>(cfg_.n_layer + 1));
  const shape bt = boundary();
  for (int c = 0; c < chunks(); ++c) {
    open_chunk(c);
    if (holds_first(c)) embed_tokens_.declare(slots_, "embed_tokens", dims);
    for (std::int64_t i = first_block(c); i < end_block(c); ++i) {
      h_[i] = std::make_unique<llama_block>(cfg_);
      slots_.activation("x." + std::to_string(i), bt, x_[i]);
      h_[i]->declare(slots_, "layers." + std::to_string(i), dims);
    }
    if (holds_last(c)) {
      slots_.activation("x." + std::to_string(cfg_.n_layer), bt, x_[cfg_.n_layer]);
      norm_.declare(slots_, "norm", dims);
      if (!cfg_.tie_embeddings) {
        lm_head_.declare(slots_, "lm_head", dims);
      } else if (!first_) {
        auto sc = slots_.enter("embed_tokens");
        slots_.param("weight", {cfg_.vocab, cfg_.dim}, head_w_, head_dw_);
      }
      slots_.activation("norm_out", bt, norm_out_);
      slots_.activation("logits", {dims.rows(), cfg_.vocab}, logits_);
      loss_.declare(slots_, "loss", dims);
    }
    close_chunk(c);
  }
  slots_.scratch("dx_a", bt, dx_a_);
  slots_.scratch("dx_b", bt, dx_b_);
  plan_memory();
  if (last_ && !cfg_.tie_embeddings) {
    head_w_ = lm_head_.weight;
    head_dw_ = lm_head_.dweight;
  } else if (last_ && first_) {
    head_w_ = embed_tokens_.weight;
    head_dw_ = embed_tokens_.dweight;
  }
  if (cfg_.tie_embeddings && stages() > 1 && (first_ || last_))
    set_tied("embed_tokens.weight", first_ ? embed_tokens_.dweight : head_dw_);
}

void llama_stage::match(const slot_list& full, bool full_grads, bool own_grads,
                        bool into_own) const {
  std::map<std::string, const tensor_slot*> by_name;
  for (const auto& s : full.slots())
    if (s.kind == slot_kind::param) by_name[s.name] = &s;
  for (const auto& s : slots_.slots()) {
    if (s.kind != slot_kind::param) continue;
    auto it = by_name.find(s.name);
    TROUPE_CHECK(it != by_name.end(), "llama_stage: the full model has no parameter '", s.name,
                 "'");
    const tensor& f = full_grads ? *it->second->grad : *it->second->field;
    const tensor& own = own_grads ? *s.grad : *s.field;
    TROUPE_CHECK(f.sizes() == own.sizes(), "llama_stage: parameter '", s.name, "' is ",
                 own.sizes().str(), " here but ", f.sizes().str(), " in the full model");
    if (into_own)
      ops::copy(f, own);
    else
      ops::copy(own, f);
  }
}

void llama_stage::load_from(const slot_list& full, bool from_grads, bool to_grads) {
  match(full, from_grads, to_grads, /*into_own=*/true);
}

void llama_stage::store_to(const slot_list& full, bool from_grads, bool to_grads) const {
  match(full, to_grads, from_grads, /*into_own=*/false);
}

void llama_stage::init_weights(std::uint64_t seed) {
  llama full(cfg_, {1, 1});
  full.init_weights(seed);
  load_from(full.slots());
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
  const std::int64_t rows = dims().rows();
  norm_.forward(x_[cfg_.n_layer], norm_out_);
  ops::matmul(norm_out_.reshape({rows, cfg_.dim}), head_w_.transpose(0, 1), logits_);
  return loss_.forward(logits_, targets.reshape({rows}));
}

void llama_stage::run_backward(int c, const tensor& dy, const tensor& dx, double weight,
                               const block_hook& after_block) {
  const std::int64_t a = first_block(c), b = end_block(c);
  const tensor& da = dx_a_;
  const tensor& db = dx_b_;
  tensor g = dy;
  if (holds_last(c)) {
    const std::int64_t rows = dims().rows();
    loss_.backward(logits_, weight);  // the logits become their gradient
    // Head: dW += dlogits^T norm_out; dnorm_out = dlogits W.
    ops::matmul(logits_.transpose(0, 1), norm_out_.reshape({rows, cfg_.dim}), head_dw_, 1.0, 1.0);
    ops::matmul(logits_, head_w_, da.reshape({rows, cfg_.dim}));
    norm_.backward(da, db);
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
  if (!holds_last(c)) return;
  if (count_saved_.size() <= slot) count_saved_.resize(slot + 1);
  count_saved_[slot] = loss_.count;
}

void llama_stage::restore_extra(int c, std::size_t slot) {
  if (holds_last(c)) loss_.count = count_saved_[slot];
}

}  // namespace troupe::models::parallel
