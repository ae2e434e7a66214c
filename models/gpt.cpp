// gpt: GPT-2's block, ends and family, the trunk instantiated for it, and its init (gpt.hpp).
#include "models/gpt.hpp"

#include <cmath>
#include <string>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

gpt_block::gpt_block(const config& c)
    : ln_1({.dim = c.dim, .eps = c.ln_eps}),
      ln_2({.dim = c.dim, .eps = c.ln_eps}),
      attn({.dim = c.dim, .n_head = c.n_head, .n_kv_head = c.n_kv_head, .rope = c.rope}),
      ff({.dim = c.dim, .hidden = c.hidden > 0 ? c.hidden : 4 * c.dim}) {}

gpt_ends::gpt_ends(const gpt_config& c)
    : dim(c.dim),
      vocab(c.vocab),
      wte({.vocab = c.vocab, .dim = c.dim}),
      wpe({.vocab = c.max_seq, .dim = c.dim, .split_vocab = false}),
      ln_f({.dim = c.dim, .eps = c.ln_eps}) {}

void gpt_ends::declare_front(slot_list& s, batch_dims d) {
  wte.declare(s, "wte", d);
  wpe.declare(s, "wpe", {1, d.seq});
}

void gpt_ends::declare_back(slot_list& s, batch_dims d) {
  shape bt{d.batch, d.seq, dim};
  ln_f.declare(s, "ln_f", d);
  s.activation("pos_emb", {d.seq, dim}, pos_emb);
  s.activation("ln_f_out", bt, ln_f_out);
  s.activation("logits", {d.rows(), vocab}, logits);
  loss.declare(s, "loss", d);
  s.scratch("dx_a", bt, dx_a);
  s.scratch("dx_b", bt, dx_b);
  s.scratch("dpos", {d.seq, dim}, dpos);
}

void gpt_ends::embed(const tensor& ids, const tensor& positions, const tensor& x0) {
  const std::int64_t b = ids.size(0), t = ids.size(1);
  tensor pos = planned_view(pos_emb, {t, dim}, "gpt", "pos_emb");
  wte.forward(ids, x0);
  row_positions = positions.dim() == 2 ? positions : tensor{};
  if (!row_positions.defined()) wpe.forward(positions, pos);
  for (std::int64_t r = 0; r < b; ++r) {
    if (row_positions.defined()) ops::embedding(positions.select(0, r), wpe.weight, pos);
    tensor xr = x0.select(0, r);
    ops::add(xr, pos, xr);
  }
}

double gpt_ends::head(const tensor& x, const tensor& targets) {
  const std::int64_t b = x.size(0), t = x.size(1);
  ln_f_cur = planned_view(ln_f_out, x.sizes(), "gpt", "ln_f_out");
  ln_f.forward(x, ln_f_cur);
  logits_cur = planned_view(logits, {b * t, vocab}, "gpt", "logits");
  ops::matmul(ln_f_cur.reshape({b * t, dim}), wte.weight.transpose(0, 1), logits_cur);
  return loss.forward(logits_cur, targets.reshape({b * t}));
}

void gpt_ends::head_backward(double loss_scale, tensor& dx, tensor& spare) {
  const shape& bt = ln_f_cur.sizes();
  const std::int64_t rows = bt[0] * bt[1];
  tensor dlogits = logits_cur;  // overwritten in place
  loss.backward(dlogits, loss_scale);
  spare = planned_view(dx_a, bt, "gpt", "dx_a");
  dx = planned_view(dx_b, bt, "gpt", "dx_b");
  tensor hf = ln_f_cur.reshape({rows, dim});
  // Tied head: dwte += dlogits^T ln_f_out; dln_f_out = dlogits wte.
  ops::matmul(dlogits.transpose(0, 1), hf, wte.dweight, 1.0, 1.0);
  ops::matmul(dlogits, wte.weight, spare.reshape({rows, dim}));
  ln_f.backward(spare, dx);
}

void gpt_ends::embed_backward(const tensor& dx0) {
  wte.backward(dx0);
  if (row_positions.defined()) {  // packed rows: each row's positions of its own
    for (std::int64_t r = 0; r < dx0.size(0); ++r)
      ops::embedding_backward(row_positions.select(0, r), dx0.select(0, r), wpe.dweight);
    return;
  }
  tensor d = planned_view(dpos, {dx0.size(1), dim}, "gpt", "dpos");
  ops::fill(d, 0.0);
  for (std::int64_t r = 0; r < dx0.size(0); ++r) ops::add(d, dx0.select(0, r), d);
  wpe.backward(d);
}

tensor gpt_ends::last_logits(const tensor& x) {
  const std::int64_t b = x.size(0), t = x.size(1);
  tensor hf = planned_view(ln_f_out, x.sizes(), "gpt", "ln_f_out");
  ln_f.forward(x, hf);
  tensor out = planned_view(logits, {b, vocab}, "gpt", "logits");
  ops::matmul(hf.select(1, t - 1), wte.weight.transpose(0, 1), out);
  return out;
}

gpt_config gpt_family::checked(const gpt_config& cfg) {
  TROUPE_CHECK(cfg.vocab > 0 && cfg.dim > 0 && cfg.n_layer > 0 && cfg.n_head > 0 && cfg.max_seq > 0,
               "gpt: vocab, dim, n_layer, n_head and max_seq must be positive");
  TROUPE_CHECK(cfg.hidden >= 0 && cfg.init_std >= 0 && cfg.ln_eps > 0,
               "gpt: hidden (n_inner) and init_std must be >= 0 and ln_eps > 0, got ", cfg.hidden,
               ", ", cfg.init_std, ", ", cfg.ln_eps);
  TROUPE_CHECK(cfg.dim % cfg.n_head == 0, "gpt: dim (", cfg.dim, ") must be a multiple of n_head (",
               cfg.n_head, ")");
  return cfg;
}

gpt_block::config gpt_family::block_config(const gpt_config& c) {
  return {.dim = c.dim, .n_head = c.n_head, .ln_eps = c.ln_eps, .hidden = c.hidden};
}

template class trunk<gpt_family>;

gpt::gpt(const gpt_config& cfg, batch_dims dims, dtype t, device dev)
    : trunk(cfg, dims, t, dev),
      mem_(cfg_.unbound ? layer_memory() : layer_memory(slots_, t, dev)) {}

void gpt::init_weights(std::uint64_t seed) {
  init_values(seed, store_param);
}

void gpt::init_values(std::uint64_t seed, const init_sink& each) const {
  // The residual projections (o_proj, mlp.proj: param_spec::residual_out) get N(0, init_std /
  // sqrt(2 n_layer)), as GPT2PreTrainedModel._init_weights.
  draw_init(slots_, seed, cfg_.init_std, 1.0 / std::sqrt(2.0 * static_cast<double>(cfg_.n_layer)),
            each);
}

}  // namespace troupe::models
