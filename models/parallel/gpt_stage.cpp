// gpt_stage: a GPT-2 pipeline stage over the tensor-parallel layers (see gpt_stage.hpp).
#include "models/parallel/gpt_stage.hpp"

#include <map>
#include <string>

#include "memory/error.hpp"
#include "models/parallel/param_slices.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

namespace {

shape gpt_boundary(const gpt_config& cfg, batch_dims dims, tp_group tp) {
  TROUPE_CHECK(cfg.n_layer > 0 && cfg.n_head > 0 && cfg.dim % cfg.n_head == 0,
               "gpt_stage: n_layer and n_head must be > 0 and dim (", cfg.dim,
               ") a multiple of n_head (", cfg.n_head, ")");
  TROUPE_CHECK(dims.seq <= cfg.max_seq, "gpt_stage: sequence length ", dims.seq,
               " exceeds max_seq ", cfg.max_seq);
  std::int64_t t = tp.sequence_parallel
                       ? divide_by_tp(dims.seq, tp.size(), "gpt_stage: sequence length")
                       : dims.seq;
  return {dims.batch, t, cfg.dim};
}

}  // namespace

gpt_stage::gpt_stage(const gpt_config& cfg, batch_dims dims, const stage_options& o, tp_group tp)
    : pipeline_stage("gpt_stage", cfg.n_layer, dims, o, tp, gpt_boundary(cfg, dims, tp)),
      cfg_(cfg),
      wte_({.vocab = cfg.vocab, .dim = cfg.dim}, tp),
      wpe_({.vocab = cfg.max_seq, .dim = cfg.dim, .split_vocab = false}),
      ln_f_({.dim = cfg.dim, .eps = cfg.ln_eps}, tp),
      loss_({.vocab = cfg.vocab}, tp) {
  seq_local_ = boundary()[1];
  seq_first_ = tp.sequence_parallel ? tp.rank() * seq_local_ : 0;
  first_ = holds_first(0);
  last_ = holds_last(chunks() - 1);
  head_.tp = tp;
  h_.resize(static_cast<std::size_t>(cfg.n_layer));
  x_.resize(static_cast<std::size_t>(cfg.n_layer + 1));
  const gpt_block::config bc{
      .dim = cfg.dim, .n_head = cfg.n_head, .ln_eps = cfg.ln_eps, .hidden = cfg.hidden};
  const shape bt = boundary();
  for (int c = 0; c < chunks(); ++c) {
    open_chunk(c);
    if (holds_first(c)) {
      wte_.declare(slots_, "wte", dims);
      wpe_.declare(slots_, "wpe", {1, dims.seq});
      slots_.activation("pos_emb", {seq_local_, cfg.dim}, pos_emb_);
    }
    for (std::int64_t i = first_block(c); i < end_block(c); ++i) {
      h_[i] = std::make_unique<tp_gpt_block>(bc, tp);
      slots_.activation("x." + std::to_string(i), bt, x_[i]);
      const auto mark = slots_.mark_block(i);
      h_[i]->declare(slots_, "h." + std::to_string(i), dims);
    }
    if (holds_last(c)) {
      slots_.activation("x." + std::to_string(cfg.n_layer), bt, x_[cfg.n_layer]);
      ln_f_.declare(slots_, "ln_f", dims);
      {
        auto sc = slots_.enter("head");
        head_.declare(slots_, dims, cfg.dim, "gpt_stage head");
      }
      if (!first_) {
        auto sc = slots_.enter("wte");
        param_spec spec = param_spec::split_along(0);
        spec.embedding = true;  // the tied head's copy of wte
        slots_.param("weight", {wte_.local_vocab, cfg.dim}, head_w_, head_dw_, std::move(spec));
      }
      slots_.activation("ln_f_out", bt, ln_f_out_);
      slots_.activation("logits", {dims.rows(), wte_.local_vocab}, logits_);
      loss_.declare(slots_, "loss", dims);
    }
    close_chunk(c);
  }
  slots_.scratch("dx_a", bt, dx_a_);
  slots_.scratch("dx_b", bt, dx_b_);
  if (first_) {
    slots_.scratch("dpos", {dims.seq, cfg.dim}, dpos_);
    if (tp.sequence_parallel) {
      slots_.scratch("dx0_full", {dims.batch, dims.seq, cfg.dim}, dx0_full_);
      slots_.scratch("dx0_gather_buf", {dims.rows() * cfg.dim}, gather_buf_);
    }
  }
  set_recompute(cfg.recompute);
  plan_memory();
  if (first_ && last_) {
    head_w_ = wte_.weight;
    head_dw_ = wte_.dweight;
  }
  if (stages() > 1 && (first_ || last_)) set_tied("wte.weight", first_ ? wte_.dweight : head_dw_);
  pos_ids_ = empty({cfg.max_seq}, dtype::i32);
  for (std::int64_t i = 0; i < cfg.max_seq; ++i)
    pos_ids_.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(i);
  set_generation_shape(divide_by_tp(cfg.n_head, tp.size(), "gpt_stage: n_head"),
                       cfg.dim / cfg.n_head, cfg.vocab, cfg.max_seq);
}

void gpt_stage::load_from(const slot_list& full, bool from_grads, bool to_grads) {
  copy_slices_by_name(slots_, full, from_grads, to_grads, /*into_piece=*/true, tp(), "gpt_stage");
}

void gpt_stage::store_to(const slot_list& full, bool from_grads, bool to_grads) const {
  copy_slices_by_name(slots_, full, to_grads, from_grads, /*into_piece=*/false, tp(), "gpt_stage");
}

void gpt_stage::init_weights(std::uint64_t seed) {
  gpt_config whole = cfg_;
  whole.unbound = true;
  const gpt full(whole, {1, 1});
  init_slices([&](const init_sink& each) { full.init_values(seed, each); }, slots_, tp(),
              "gpt_stage");
}

double gpt_stage::run_forward(int c, const tensor& in, const tensor& targets, const tensor& y) {
  const std::int64_t a = first_block(c), b = end_block(c);
  if (holds_first(c)) {
    wte_.forward(in, x_[a]);
    tensor pos = planned_view(pos_emb_, {seq_local_, cfg_.dim}, "gpt_stage", "pos_emb");
    wpe_.forward(pos_ids_.narrow(0, seq_first_, seq_local_), pos);
    for (std::int64_t r = 0; r < dims().batch; ++r) {
      tensor xr = x_[a].select(0, r);
      ops::add(xr, pos, xr);
    }
  } else {
    ops::copy(in, x_[a]);
  }
  for (std::int64_t i = a; i < b; ++i)
    h_[i]->forward(x_[i], i + 1 == b && !holds_last(c) ? y : x_[i + 1]);
  if (!holds_last(c)) return 0.0;
  const std::int64_t rows = dims().rows();
  ln_f_.forward(x_[cfg_.n_layer], ln_f_out_);
  tensor hf = head_.forward(ln_f_out_);  // [B, T, C] (SP: gathered)
  ops::matmul(hf.reshape({rows, cfg_.dim}), head_w_.transpose(0, 1), logits_);
  return loss_.forward(logits_, targets.reshape({rows}));
}

void gpt_stage::step_chunk(int c, const tensor& in, const tensor& y, std::int64_t start) {
  const std::int64_t a = first_block(c), e = end_block(c);
  const std::int64_t b = in.size(0), n = in.size(1);
  auto x = [&](std::int64_t i) { return planned_view(x_[i], {b, n, cfg_.dim}, "gpt_stage", "x"); };
  tensor x0 = in;
  if (holds_first(c)) {
    x0 = x(a);
    tensor pos = planned_view(pos_emb_, {n, cfg_.dim}, "gpt_stage", "pos_emb");
    wte_.forward_full_sequence(in, x0);
    wpe_.forward(pos_ids_.narrow(0, start, n), pos);
    for (std::int64_t r = 0; r < b; ++r) {
      tensor xr = x0.select(0, r);
      ops::add(xr, pos, xr);
    }
  }
  for (std::int64_t i = a; i < e; ++i)
    h_[i]->forward_step(i == a ? x0 : x(i), i + 1 == e && !holds_last(c) ? y : x(i + 1), cached(i),
                        start);
  if (!holds_last(c)) return;
  // The tied head on the last position: the shard's vocabulary rows of wte.
  tensor hf = planned_view(ln_f_out_, {b, n, cfg_.dim}, "gpt_stage", "ln_f_out");
  ln_f_.forward(x(cfg_.n_layer), hf);
  ops::matmul(hf.select(1, n - 1), head_w_.transpose(0, 1), generation().local_logits(b));
}

void gpt_stage::run_backward(int c, const tensor& dy, const tensor& dx, double weight,
                             const block_hook& after_block) {
  const std::int64_t a = first_block(c), b = end_block(c);
  const batch_dims d = dims();
  const tensor& da = dx_a_;
  const tensor& db = dx_b_;
  tensor g = dy;
  if (holds_last(c)) {
    const std::int64_t rows = d.rows();
    loss_.backward(logits_, weight);  // the logits become their gradient
    tensor hf = tp().sequence_parallel
                    ? planned_view(head_.x_full, {d.batch, d.seq, cfg_.dim}, "gpt_stage", "head")
                    : ln_f_out_;
    // Tied head: dwte += dlogits^T hf; d(hf) = dlogits wte (a partial sum over the shards).
    ops::matmul(logits_.transpose(0, 1), hf.reshape({rows, cfg_.dim}), head_dw_, 1.0, 1.0);
    tensor dhf = head_.grad_buffer(da);
    ops::matmul(logits_, head_w_, dhf.reshape({rows, cfg_.dim}));
    head_.backward(dhf, da);
    ln_f_.backward(da, db);
    g = db;
  }
  for (std::int64_t i = b - 1; i >= a; --i) {
    tensor out = i == a && !holds_first(c) ? dx : (g.data() == da.data() ? db : da);
    h_[i]->backward(g, out);
    if (after_block) after_block(i);
    g = out;
  }
  if (!holds_first(c)) return;
  // g holds d(x0): tokens, then positions (SP: gathered so every shard adds all positions).
  wte_.backward(g);
  tensor d0 = g;
  if (tp().sequence_parallel) {
    d0 = planned_view(dx0_full_, {d.batch, d.seq, cfg_.dim}, "gpt_stage", "dx0_full");
    gather_sequence(tp(), g, d0, gather_buf_);
  }
  tensor dpos = planned_view(dpos_, {d.seq, cfg_.dim}, "gpt_stage", "dpos");
  ops::fill(dpos, 0.0);
  for (std::int64_t r = 0; r < d.batch; ++r) ops::add(dpos, d0.select(0, r), dpos);
  wpe_.ids = pos_ids_.narrow(0, 0, d.seq);  // every position, as d0 covers them all
  wpe_.backward(dpos);
}

void gpt_stage::save_extra(int c, std::size_t slot) {
  if (holds_first(c)) {
    if (wte_saved_.size() <= slot) wte_saved_.resize(slot + 1);
    wte_saved_[slot] = wte_;
  }
  if (holds_last(c)) {
    if (count_saved_.size() <= slot) count_saved_.resize(slot + 1);
    count_saved_[slot] = loss_.count;
  }
}

void gpt_stage::restore_extra(int c, std::size_t slot) {
  if (holds_first(c)) wte_ = wte_saved_[slot];
  if (holds_last(c)) loss_.count = count_saved_[slot];
}

}  // namespace troupe::models::parallel
