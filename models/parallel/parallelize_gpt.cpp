// tp_gpt: the tensor-parallel GPT-2 and parallelize_gpt (see parallelize_gpt.hpp).
#include "models/parallel/parallelize_gpt.hpp"

#include <map>
#include <string>

#include "memory/error.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

tp_gpt::tp_gpt(const gpt_config& cfg, batch_dims dims, tp_group tp)
    : cfg_(cfg),
      dims_(dims),
      tp_(tp),
      wte_({.vocab = cfg.vocab, .dim = cfg.dim}, tp),
      wpe_({.vocab = cfg.max_seq, .dim = cfg.dim, .split_vocab = false}),
      ln_f_({.dim = cfg.dim, .eps = cfg.ln_eps}, tp),
      loss_({.vocab = cfg.vocab}, tp) {
  TROUPE_CHECK(cfg.dim % cfg.n_head == 0, "tp_gpt: dim (", cfg.dim,
               ") must be a multiple of n_head (", cfg.n_head, ")");
  TROUPE_CHECK(dims.seq <= cfg.max_seq, "tp_gpt: sequence length ", dims.seq, " exceeds max_seq ",
               cfg.max_seq);
  seq_local_ = tp.sequence_parallel ? divide_by_tp(dims.seq, tp.size(), "tp_gpt: sequence length")
                                    : dims.seq;
  head_.tp = tp;
  h_.reserve(cfg.n_layer);
  for (std::int64_t i = 0; i < cfg.n_layer; ++i)
    h_.emplace_back(
        gpt_block::config{
            .dim = cfg.dim, .n_head = cfg.n_head, .ln_eps = cfg.ln_eps, .hidden = cfg.hidden},
        tp);
  x_.resize(cfg.n_layer + 1);

  shape bt{dims.batch, seq_local_, cfg.dim};
  wte_.declare(slots_, "wte", dims);
  wpe_.declare(slots_, "wpe", {1, dims.seq});
  for (std::int64_t i = 0; i < cfg.n_layer; ++i) {
    slots_.activation("x." + std::to_string(i), bt, x_[i]);
    const auto mark = slots_.mark_block(i);
    h_[i].declare(slots_, "h." + std::to_string(i), dims, cfg.recompute);
  }
  slots_.activation("x." + std::to_string(cfg.n_layer), bt, x_[cfg.n_layer]);
  ln_f_.declare(slots_, "ln_f", dims);
  {
    auto sc = slots_.enter("head");
    head_.declare(slots_, dims, cfg.dim, "tp_gpt head");
  }
  slots_.activation("pos_emb", {seq_local_, cfg.dim}, pos_emb_);
  slots_.activation("ln_f_out", bt, ln_f_out_);
  slots_.activation("logits", {dims.rows(), wte_.local_vocab}, logits_);
  loss_.declare(slots_, "loss", dims);
  slots_.scratch("dx_a", bt, dx_a_);
  slots_.scratch("dx_b", bt, dx_b_);
  slots_.scratch("dpos", {dims.seq, cfg.dim}, dpos_);
  if (tp.sequence_parallel) {
    slots_.scratch("dx0_full", {dims.batch, dims.seq, cfg.dim}, dx0_full_);
    slots_.scratch("dx0_gather_buf", {dims.rows() * cfg.dim}, gather_buf_);
  }
  mem_ = layer_memory(slots_, dtype::f32, device::cpu());
  pos_ids_ = empty({cfg.max_seq}, dtype::i32);
  for (std::int64_t i = 0; i < cfg.max_seq; ++i)
    pos_ids_.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(i);
}

void tp_gpt::load_from(const slot_list& full, bool from_grads, bool to_grads) {
  copy_slices_by_name(slots_, full, from_grads, to_grads, /*into_piece=*/true, tp_, "tp_gpt");
}

void tp_gpt::init_weights(std::uint64_t seed) {
  gpt_config whole = cfg_;
  whole.unbound = true;
  const gpt full(whole, {1, 1});
  init_slices([&](const init_sink& each) { full.init_values(seed, each); }, slots_, tp_, "tp_gpt");
}

double tp_gpt::forward(const tensor& ids, const tensor& targets) {
  const batch_dims got = checked_batch(ids, targets, dims_, "tp_gpt");
  b_ = got.batch;
  t_ = got.seq;
  std::int64_t tl =
      tp_.sequence_parallel ? divide_by_tp(t_, tp_.size(), "tp_gpt: sequence length") : t_;
  std::int64_t first = tp_.sequence_parallel ? tp_.rank() * tl : 0;
  shape bt{b_, tl, cfg_.dim};
  auto x = [&](std::int64_t i) { return planned_view(x_[i], bt, "tp_gpt", "x"); };
  tensor pos = planned_view(pos_emb_, {tl, cfg_.dim}, "tp_gpt", "pos_emb");
  wte_.forward(ids, x(0));
  wpe_.forward(pos_ids_.narrow(0, first, tl), pos);
  for (std::int64_t b = 0; b < b_; ++b) {
    tensor xb = x(0).select(0, b);
    ops::add(xb, pos, xb);
  }
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i) {
    notify(on_block_use, i, block_use::before_forward);
    h_[i].forward(x(i), x(i + 1));
    notify(on_block_use, i, block_use::after_forward);
  }
  ln_f_cur_ = planned_view(ln_f_out_, bt, "tp_gpt", "ln_f_out");
  ln_f_.forward(x(cfg_.n_layer), ln_f_cur_);
  tensor hf = head_.forward(ln_f_cur_);  // [B, T, C]
  logits_cur_ = planned_view(logits_, {b_ * t_, wte_.local_vocab}, "tp_gpt", "logits");
  ops::matmul(hf.reshape({b_ * t_, cfg_.dim}), wte_.weight.transpose(0, 1), logits_cur_);
  return loss_.forward(logits_cur_, targets.reshape({b_ * t_}));
}

void tp_gpt::backward(double loss_scale) {
  TROUPE_CHECK(b_ > 0, "tp_gpt: backward called before forward");
  std::int64_t tl = tp_.sequence_parallel ? t_ / tp_.size() : t_;
  shape bt{b_, tl, cfg_.dim};
  tensor dlogits = logits_cur_;  // overwritten in place
  loss_.backward(dlogits, loss_scale);
  tensor da = planned_view(dx_a_, bt, "tp_gpt", "dx_a"),
         db = planned_view(dx_b_, bt, "tp_gpt", "dx_b");
  tensor hf = tp_.sequence_parallel
                  ? planned_view(head_.x_full, {b_, t_, cfg_.dim}, "tp_gpt", "head x_full")
                  : ln_f_cur_;
  // Tied head on the shard's vocabulary rows: dwte += dlogits^T hf; d(hf) = dlogits wte (partial).
  ops::matmul(dlogits.transpose(0, 1), hf.reshape({b_ * t_, cfg_.dim}), wte_.dweight, 1.0, 1.0);
  tensor dhf = head_.grad_buffer(da);
  ops::matmul(dlogits, wte_.weight, dhf.reshape({b_ * t_, cfg_.dim}));
  head_.backward(dhf, da);
  ln_f_.backward(da, db);
  auto x = [&](std::int64_t i) { return planned_view(x_[i], bt, "tp_gpt", "x"); };
  for (std::int64_t i = cfg_.n_layer - 1; i >= 0; --i) {
    notify(on_block_use, i, block_use::before_backward);
    // The last block's activations are still those of the forward: the head's buffers (SP
    // included) are not the blocks' shared activation bytes (scratch has its own arena).
    if (cfg_.recompute && i + 1 < cfg_.n_layer) h_[i].recompute(x(i));
    h_[i].backward(db, da);
    notify(on_block_use, i, block_use::after_backward);
    std::swap(da, db);
  }
  // db holds d(x0): tokens, then positions (SP: gathered so every shard adds all positions).
  wte_.backward(db);
  tensor d0 = db;
  if (tp_.sequence_parallel) {
    d0 = planned_view(dx0_full_, {b_, t_, cfg_.dim}, "tp_gpt", "dx0_full");
    gather_sequence(tp_, db, d0, gather_buf_);
  }
  tensor dpos = planned_view(dpos_, {t_, cfg_.dim}, "tp_gpt", "dpos");
  ops::fill(dpos, 0.0);
  for (std::int64_t b = 0; b < b_; ++b) ops::add(dpos, d0.select(0, b), dpos);
  wpe_.ids = pos_ids_.narrow(0, 0, t_);  // every position, as d0 covers them all
  wpe_.backward(dpos);
}

void tp_gpt::begin_generation(std::int64_t batch, std::int64_t capacity) {
  const auto& a = h_[0].attn.local.cfg;  // the shard's heads
  begin_tp_generation(gen_,
                      {.n_layer = cfg_.n_layer,
                       .batch = batch,
                       .capacity = capacity,
                       .n_kv_head = a.n_kv_head,
                       .head_dim = a.head_dim,
                       .vocab = cfg_.vocab,
                       .rows = seq_local_,
                       .max_batch = dims_.batch,
                       .max_step = dims_.seq,
                       .max_seq = cfg_.max_seq},
                      tp_, "tp_gpt");
}

tensor tp_gpt::step_logits(const tensor& ids) {
  TROUPE_CHECK(gen_ != nullptr, "tp_gpt: step_logits called before begin_generation");
  const std::int64_t b = ids.dim() == 2 ? ids.size(0) : 0;
  auto x = [&](std::int64_t i, std::int64_t n) {
    return planned_view(x_[i], {b, n, cfg_.dim}, "tp_gpt", "x");
  };
  const std::int64_t n = gen_->run(ids, "tp_gpt", [&](const tensor& part, std::int64_t start) {
    const std::int64_t t = part.size(1);
    tensor pos = planned_view(pos_emb_, {t, cfg_.dim}, "tp_gpt", "pos_emb");
    wte_.forward_full_sequence(part, x(0, t));
    wpe_.forward(pos_ids_.narrow(0, start, t), pos);
    for (std::int64_t r = 0; r < b; ++r) {
      tensor xr = x(0, t).select(0, r);
      ops::add(xr, pos, xr);
    }
    for (std::int64_t i = 0; i < cfg_.n_layer; ++i)
      h_[i].forward_step(x(i, t), x(i + 1, t), gen_->layer(i), start);
  });
  // The tied head on the last position: the shard's vocabulary rows of wte, then all of them.
  tensor hf = planned_view(ln_f_out_, {b, n, cfg_.dim}, "tp_gpt", "ln_f_out");
  ln_f_.forward(x(cfg_.n_layer, n), hf);
  ops::matmul(hf.select(1, n - 1), wte_.weight.transpose(0, 1), gen_->local_logits(b));
  return gen_->gather(b);
}

std::unique_ptr<tp_gpt> parallelize_gpt(const gpt& model, batch_dims dims,
                                        collective::communicator& tp, bool sequence_parallel) {
  auto m = std::make_unique<tp_gpt>(model.config(), dims, tp_group{&tp, sequence_parallel});
  m->load_from(model);
  return m;
}

}  // namespace troupe::models
