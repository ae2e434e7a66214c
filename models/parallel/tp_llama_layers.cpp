// The Llama pieces of a tensor shard (see tp_llama_layers.hpp).
#include "models/parallel/tp_llama_layers.hpp"

#include "memory/error.hpp"
#include "models/parallel/param_slices.hpp"
#include "models/parallel/tp_compose.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

llama_config resolve_tp_llama_config(llama_config c, const tp_group& tp, std::string_view who) {
  TROUPE_CHECK(c.n_layer > 0 && c.n_head > 0 && c.dim > 0 && c.vocab > 0 && c.hidden > 0, who,
               ": n_layer, n_head, dim, vocab and hidden (intermediate_size) must be > 0");
  if (c.n_kv_head == 0) c.n_kv_head = c.n_head;
  if (c.head_dim == 0) {
    TROUPE_CHECK(c.dim % c.n_head == 0, who, ": dim (", c.dim, ") must be a multiple of n_head (",
                 c.n_head, ")");
    c.head_dim = c.dim / c.n_head;
  }
  TROUPE_CHECK(c.n_head % c.n_kv_head == 0, who, ": n_head (", c.n_head,
               ") must be a multiple of n_kv_head (", c.n_kv_head, ")");
  const int n = tp.size();
  auto divides = [&](std::int64_t value, const char* field) {
    TROUPE_CHECK(value % n == 0, who, ": parallel.tp = ", n, " does not divide ", field, " = ",
                 value);
  };
  divides(c.n_head, "n_head (num_attention_heads)");
  divides(c.n_kv_head, "n_kv_head (num_key_value_heads)");
  divides(c.hidden, "hidden (intermediate_size)");
  divides(c.vocab, "vocab (vocab_size)");
  return c;
}

// ---- tp_swiglu_mlp ----------------------------------------------------------------------------

tp_swiglu_mlp::tp_swiglu_mlp(const swiglu_mlp::config& c, tp_group g)
    : cfg(c),
      tp(g),
      local(
          {.dim = c.dim,
           .hidden = divide_by_tp(c.hidden, g.size(), "tp_swiglu_mlp: hidden (intermediate_size)"),
           .bias = c.bias,
           .out_bias = false}) {  // added once, after the reduction (exit)
  entry.tp = g;
  exit.tp = g;
}

void tp_swiglu_mlp::declare(slot_list& s, std::string_view name, batch_dims b) {
  auto sc = s.enter(name);
  label = "tp_swiglu_mlp '" + s.prefix() + "'";
  if (tp.sequence_parallel) divide_by_tp(b.seq, tp.size(), label + ": sequence length");
  entry.declare(s, b, cfg.dim, label);
  exit.declare(s, b, cfg.dim, cfg.out_bias, "down_proj", label);
  local.declare(s, "", b);
}

void tp_swiglu_mlp::forward(const tensor& x, const tensor& y) {
  region_forward(entry, local, exit, x, y);
}

void tp_swiglu_mlp::backward(const tensor& dy, const tensor& dx) {
  region_backward(entry, local, exit, dy, dx);
}

void tp_swiglu_mlp::forward_step(const tensor& x, const tensor& y) {
  local.forward(x, y);  // entered by identity: x is whole on every shard
  exit.forward_full_sequence(y);
}

void tp_swiglu_mlp::load_from(const swiglu_mlp& full) {
  int r = tp.rank(), n = tp.size();
  copy_shard(full.gate_proj.weight, 0, r, n, local.gate_proj.weight);
  copy_shard(full.up_proj.weight, 0, r, n, local.up_proj.weight);
  copy_shard(full.down_proj.weight, 1, r, n, local.down_proj.weight);
  if (cfg.bias) {
    copy_shard(full.gate_proj.bias, 0, r, n, local.gate_proj.bias);
    copy_shard(full.up_proj.bias, 0, r, n, local.up_proj.bias);
  }
  if (cfg.out_bias) ops::copy(full.down_proj.bias, exit.bias);
}

// ---- tp_llama_block ---------------------------------------------------------------------------

tp_llama_block::tp_llama_block(const llama_config& c, tp_group g)
    : tp_llama_block(llama_block(c), g) {}

tp_llama_block::tp_llama_block(const llama_block& unsharded, tp_group g)
    : tp(g),
      input_layernorm(unsharded.input_layernorm.cfg, g),
      post_attention_layernorm(unsharded.post_attention_layernorm.cfg, g),
      self_attn(unsharded.self_attn.cfg, g),
      mlp(unsharded.mlp.cfg, g) {}

void tp_llama_block::declare(slot_list& s, std::string_view name, batch_dims b, bool recompute) {
  auto sc = recompute ? s.enter_recomputed(name) : s.enter(name);
  const shape rows =
      shard_rows(b, input_layernorm.norm.cfg.dim, tp, "tp_llama_block '" + s.prefix() + "'");
  input_layernorm.declare(s, "input_layernorm", b);
  self_attn.declare(s, "self_attn", b);
  post_attention_layernorm.declare(s, "post_attention_layernorm", b);
  mlp.declare(s, "mlp", b);
  buf.declare(s, rows);
}

void tp_llama_block::forward(const tensor& x, const tensor& y) {
  residual_forward(input_layernorm, self_attn, post_attention_layernorm, mlp, buf, x, y,
                   "tp_llama_block");
}

void tp_llama_block::backward(const tensor& dy, const tensor& dx) {
  residual_backward(input_layernorm, self_attn, post_attention_layernorm, mlp, buf, dy, dx,
                    "tp_llama_block");
}

void tp_llama_block::forward_step(const tensor& x, const tensor& y, const kv_layer& cache,
                                  std::int64_t start) {
  cached_region<tp_attention> step{self_attn, cache, start};
  region_step<tp_swiglu_mlp> mlp_step{mlp};
  residual_forward(input_layernorm, step, post_attention_layernorm, mlp_step, buf, x, y,
                   "tp_llama_block");
}

// ---- tp_llama_head ----------------------------------------------------------------------------

tp_llama_head::tp_llama_head(const llama_config& c, tp_group g)
    : tp(g),
      dim(c.dim),
      tied(c.tie_embeddings),
      norm({.dim = c.dim, .eps = c.rms_eps}, g),
      loss({.vocab = c.vocab}, g) {
  entry.tp = g;
}

void tp_llama_head::declare(slot_list& s, batch_dims b, std::string_view weight_scope) {
  norm.declare(s, "norm", b);
  if (!weight_scope.empty()) {
    auto sc = s.enter(weight_scope);
    param_spec spec = param_spec::split_along(0);
    spec.embedding = tied;  // the last stage's copy of embed_tokens
    s.param("weight", {local_vocab(), dim}, weight, dweight, std::move(spec));
  }
  {
    auto sc = s.enter("head");
    entry.declare(s, b, dim, "tp_llama head");
  }
  std::int64_t seq = tp.sequence_parallel ? b.seq / tp.size() : b.seq;
  s.activation("norm_out", {b.batch, seq, dim}, norm_out_);
  s.activation("logits", {b.rows(), local_vocab()}, logits_);
  loss.declare(s, "loss", b);
}

double tp_llama_head::forward(const tensor& x, const tensor& targets) {
  TROUPE_CHECK(x.defined() && x.dim() == 3, "tp_llama head: x must be [B, T, C], got ",
               describe(x));
  b_ = x.size(0);
  t_ = tp.sequence_parallel ? x.size(1) * tp.size() : x.size(1);
  TROUPE_CHECK(targets.numel() == b_ * t_, "tp_llama head: targets ", describe(targets),
               " do not match [", b_, ", ", t_, "]");
  norm_cur_ = planned_view(norm_out_, x.sizes(), "tp_llama head", "norm_out");
  norm.forward(x, norm_cur_);
  tensor hf = entry.forward(norm_cur_);  // [B, T, C] (SP: gathered)
  logits_cur_ = planned_view(logits_, {b_ * t_, local_vocab()}, "tp_llama head", "logits");
  ops::matmul(hf.reshape({b_ * t_, dim}), weight.transpose(0, 1), logits_cur_);
  return loss.forward(logits_cur_, targets.reshape({b_ * t_}));
}

void tp_llama_head::backward(double loss_scale, const tensor& scratch, const tensor& dx) {
  TROUPE_CHECK(b_ > 0, "tp_llama head: backward called before forward");
  loss.backward(logits_cur_, loss_scale);  // the logits become their gradient
  tensor hf = tp.sequence_parallel
                  ? planned_view(entry.x_full, {b_, t_, dim}, "tp_llama head", "head x_full")
                  : norm_cur_;
  // dW += dlogits^T hf; d(hf) = dlogits W (a partial sum over the shards' vocabularies).
  ops::matmul(logits_cur_.transpose(0, 1), hf.reshape({b_ * t_, dim}), dweight, 1.0, 1.0);
  tensor dhf = entry.grad_buffer(scratch);
  ops::matmul(logits_cur_, weight, dhf.reshape({b_ * t_, dim}));
  entry.backward(dhf, scratch);
  norm.backward(scratch, dx);
}

void tp_llama_head::last_logits(const tensor& x, const tensor& logits) {
  TROUPE_CHECK(x.defined() && x.dim() == 3, "tp_llama head: a step's x must be [B, t, C], got ",
               describe(x));
  const std::int64_t b = x.size(0), t = x.size(1);
  const shape want{b, local_vocab()};
  TROUPE_CHECK(logits.defined() && logits.sizes() == want,
               "tp_llama head: a step's logits must be [", b, ", ", local_vocab(), "], got ",
               describe(logits));
  tensor hn = planned_view(norm_out_, x.sizes(), "tp_llama head", "norm_out");
  norm.forward(x, hn);
  ops::matmul(hn.select(1, t - 1), weight.transpose(0, 1), logits);
}

}  // namespace troupe::models
