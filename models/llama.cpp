// llama: Llama's block, ends and family, the trunk instantiated for it, and its init (llama.hpp).
#include "models/llama.hpp"

#include <cmath>
#include <string>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {

llama_config resolved(llama_config c) {
  TROUPE_CHECK(
      c.vocab > 0 && c.dim > 0 && c.n_layer > 0 && c.n_head > 0 && c.hidden > 0 && c.max_seq > 0,
      "llama: vocab, dim, n_layer, n_head, hidden (intermediate_size) and max_seq must "
      "be positive, got ",
      c.vocab, ", ", c.dim, ", ", c.n_layer, ", ", c.n_head, ", ", c.hidden, ", ", c.max_seq);
  if (c.n_kv_head == 0) c.n_kv_head = c.n_head;
  if (c.head_dim == 0) {
    TROUPE_CHECK(c.dim % c.n_head == 0, "llama: dim (", c.dim, ") must be a multiple of n_head (",
                 c.n_head, ")");
    c.head_dim = c.dim / c.n_head;
  }
  TROUPE_CHECK(c.n_kv_head > 0 && c.n_head % c.n_kv_head == 0, "llama: n_head (", c.n_head,
               ") must be a multiple of n_kv_head (", c.n_kv_head, ")");
  TROUPE_CHECK(c.head_dim > 0 && c.head_dim % 2 == 0, "llama: RoPE needs an even head_dim, got ",
               c.head_dim);
  TROUPE_CHECK(c.rms_eps > 0 && c.rope_theta > 0 && c.init_std >= 0,
               "llama: rms_eps and rope_theta must be > 0 and init_std >= 0, got ", c.rms_eps, ", ",
               c.rope_theta, ", ", c.init_std);
  check_rope_scaling(c.rope_scale, c.head_dim, "llama");
  return c;
}

}  // namespace

llama_block::llama_block(const llama_config& c)
    : input_layernorm({.dim = c.dim, .eps = c.rms_eps}),
      post_attention_layernorm({.dim = c.dim, .eps = c.rms_eps}),
      self_attn({.dim = c.dim,
                 .n_head = c.n_head,
                 .n_kv_head = c.n_kv_head,
                 .head_dim = c.head_dim,
                 .fused_qkv = false,
                 .qkv_bias = c.attention_bias,
                 .out_bias = c.attention_bias,
                 .rope = true,
                 .rope_theta = c.rope_theta,
                 .rope_scale = c.rope_scale}),
      mlp({.dim = c.dim, .hidden = c.hidden, .bias = c.mlp_bias, .out_bias = c.mlp_bias}) {}

llama_ends::llama_ends(const llama_config& c)
    : dim(c.dim),
      vocab(c.vocab),
      tied(c.tie_embeddings),
      embed_tokens({.vocab = c.vocab, .dim = c.dim}),
      norm({.dim = c.dim, .eps = c.rms_eps}),
      lm_head({.in = c.dim, .out = c.vocab, .bias = false, .split = tp_split::column}) {}

void llama_ends::declare_front(slot_list& s, batch_dims d) {
  embed_tokens.declare(s, "embed_tokens", d);
}

void llama_ends::declare_back(slot_list& s, batch_dims d) {
  shape bt{d.batch, d.seq, dim};
  norm.declare(s, "norm", d);
  if (!tied) lm_head.declare(s, "lm_head", d);
  s.activation("norm_out", bt, norm_out);
  s.activation("logits", {d.rows(), vocab}, logits);
  loss.declare(s, "loss", d);
  s.scratch("dx_a", bt, dx_a);
  s.scratch("dx_b", bt, dx_b);
}

void llama_ends::embed(const tensor& ids, const tensor& positions, const tensor& x0) {
  (void)positions;  // RoPE: the attention rotates by position
  embed_tokens.forward(ids, x0);
}

double llama_ends::head(const tensor& x, const tensor& targets) {
  const std::int64_t b = x.size(0), t = x.size(1);
  norm_cur = planned_view(norm_out, x.sizes(), "llama", "norm_out");
  norm.forward(x, norm_cur);
  logits_cur = planned_view(logits, {b * t, vocab}, "llama", "logits");
  ops::matmul(norm_cur.reshape({b * t, dim}), head_weight().transpose(0, 1), logits_cur);
  return loss.forward(logits_cur, targets.reshape({b * t}));
}

void llama_ends::head_backward(double loss_scale, tensor& dx, tensor& spare) {
  const shape& bt = norm_cur.sizes();
  const std::int64_t rows = bt[0] * bt[1];
  tensor dlogits = logits_cur;  // overwritten in place
  loss.backward(dlogits, loss_scale);
  spare = planned_view(dx_a, bt, "llama", "dx_a");
  dx = planned_view(dx_b, bt, "llama", "dx_b");
  tensor hn = norm_cur.reshape({rows, dim});
  // Head: dW += dlogits^T norm_out; dnorm_out = dlogits W (W is embed_tokens' when tied).
  ops::matmul(dlogits.transpose(0, 1), hn, head_grad(), 1.0, 1.0);
  ops::matmul(dlogits, head_weight(), spare.reshape({rows, dim}));
  norm.backward(spare, dx);
}

void llama_ends::embed_backward(const tensor& dx0) {
  embed_tokens.backward(dx0);
}

tensor llama_ends::last_logits(const tensor& x) {
  const std::int64_t b = x.size(0), t = x.size(1);
  tensor hn = planned_view(norm_out, x.sizes(), "llama", "norm_out");
  norm.forward(x, hn);
  tensor out = planned_view(logits, {b, vocab}, "llama", "logits");
  ops::matmul(hn.select(1, t - 1), head_weight().transpose(0, 1), out);
  return out;
}

llama_config llama_family::checked(const llama_config& c) {
  return resolved(c);
}

template class trunk<llama_family>;

llama::llama(const llama_config& cfg, batch_dims dims, dtype t, device dev)
    : trunk(cfg, dims, t, dev),
      mem_(cfg_.unbound ? layer_memory() : layer_memory(slots_, t, dev)) {}

void llama::init_weights(std::uint64_t seed) {
  init_values(seed, store_param);
}

void llama::init_values(std::uint64_t seed, const init_sink& each) const {
  draw_init(slots_, seed, cfg_.init_std, /*residual_scale=*/1.0, each);
}

}  // namespace troupe::models
