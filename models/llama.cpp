// llama: the Llama composition, forward, backward, init and cached decoding (llama.hpp).
#include "models/llama.hpp"

#include <cmath>
#include <random>
#include <string>

#include "memory/error.hpp"
#include "models/targets.hpp"
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

void llama_block::declare(slot_list& s, std::string_view name, batch_dims b, bool recompute) {
  auto scope = recompute ? s.enter_recomputed(name) : s.enter(name);
  input_layernorm.declare(s, "input_layernorm", b);
  self_attn.declare(s, "self_attn", b);
  post_attention_layernorm.declare(s, "post_attention_layernorm", b);
  mlp.declare(s, "mlp", b);
  buf.declare(s, {b.batch, b.seq, input_layernorm.cfg.dim});
}

void llama_block::forward(const tensor& x, const tensor& y) {
  run(x, y, nullptr, 0);
}

void llama_block::recompute(const tensor& x) {
  run(x, tensor{}, nullptr, 0);
}

void llama_block::forward_step(const tensor& x, const tensor& y, const kv_layer& cache,
                               std::int64_t start) {
  run(x, y, &cache, start);
}

void llama_block::run(const tensor& x, const tensor& y, const kv_layer* cache, std::int64_t start) {
  if (cache != nullptr) {
    cached_attention step{self_attn, *cache, start};
    residual_forward(input_layernorm, step, post_attention_layernorm, mlp, buf, x, y,
                     "llama_block");
  } else {
    residual_forward(input_layernorm, self_attn, post_attention_layernorm, mlp, buf, x, y,
                     "llama_block");
  }
}

void llama_block::backward(const tensor& dy, const tensor& dx) {
  residual_backward(input_layernorm, self_attn, post_attention_layernorm, mlp, buf, dy, dx,
                    "llama_block");
}

llama::llama(const llama_config& cfg_in, batch_dims dims, dtype t, device dev)
    : cfg_(resolved(cfg_in)),
      dims_(dims),
      embed_tokens_({.vocab = cfg_.vocab, .dim = cfg_.dim}),
      norm_({.dim = cfg_.dim, .eps = cfg_.rms_eps}),
      lm_head_({.in = cfg_.dim, .out = cfg_.vocab, .bias = false}),
      dtype_(t),
      dev_(dev) {
  TROUPE_CHECK(dims.batch > 0 && dims.seq > 0, "llama: the planned batch [", dims.batch, ", ",
               dims.seq, "] must be positive");
  TROUPE_CHECK(dims.seq <= cfg_.max_seq, "llama: sequence length ", dims.seq,
               " exceeds max_seq (max_position_embeddings) ", cfg_.max_seq);
  layers_.reserve(cfg_.n_layer);
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i) layers_.emplace_back(cfg_);
  x_.resize(cfg_.n_layer + 1);

  shape bt{dims.batch, dims.seq, cfg_.dim};
  embed_tokens_.declare(slots_, "embed_tokens", dims);
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i) {
    slots_.activation("x." + std::to_string(i), bt, x_[i]);
    layers_[i].declare(slots_, "layers." + std::to_string(i), dims, cfg_.recompute);
  }
  slots_.activation("x." + std::to_string(cfg_.n_layer), bt, x_[cfg_.n_layer]);
  norm_.declare(slots_, "norm", dims);
  if (!cfg_.tie_embeddings) lm_head_.declare(slots_, "lm_head", dims);
  slots_.activation("norm_out", bt, norm_out_);
  slots_.activation("logits", {dims.rows(), cfg_.vocab}, logits_);
  loss_.declare(slots_, "loss", dims);
  slots_.scratch("dx_a", bt, dx_a_);
  slots_.scratch("dx_b", bt, dx_b_);
  if (cfg_.unbound) return;
  mem_ = layer_memory(slots_, t, dev);
}

const tensor& llama::head_weight() const {
  return cfg_.tie_embeddings ? embed_tokens_.weight : lm_head_.weight;
}

const tensor& llama::head_grad() const {
  return cfg_.tie_embeddings ? embed_tokens_.dweight : lm_head_.dweight;
}

void llama::init_weights(std::uint64_t seed) {
  init_values(seed, store_param);
}

void llama::init_values(std::uint64_t seed, const init_sink& each) const {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, cfg_.init_std);
  for (const auto& s : slots_.slots()) {
    if (s.kind != slot_kind::param) continue;
    auto host = empty(s.sizes, dtype::f64);
    double* p = host.data_as<double>();
    const std::string& n = s.name;
    bool is_norm = n.find("layernorm.") != std::string::npos || n == "norm.weight";
    bool is_bias = n.size() >= 5 && n.compare(n.size() - 5, 5, ".bias") == 0;
    for (std::int64_t i = 0; i < host.numel(); ++i)
      p[i] = is_norm ? 1.0 : is_bias ? 0.0 : normal(gen);
    each(s, host);
  }
}

void llama::check_ids(const tensor& ids, const char* what) const {
  TROUPE_CHECK(ids.defined() && ids.dim() == 2 && ids.type() == dtype::i32, "llama: ", what,
               " must be i32 [B, T], got ", describe(ids));
}

double llama::forward(const tensor& ids, const tensor& targets) {
  const batch_dims got = checked_batch(ids, targets, dims_, "llama");
  b_ = got.batch;
  t_ = got.seq;
  shape bt{b_, t_, cfg_.dim};
  auto x = [&](std::int64_t i) { return planned_view(x_[i], bt, "llama", "x"); };
  embed_tokens_.forward(ids, x(0));
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i) {
    notify(on_block_use, i, block_use::before_forward);
    layers_[i].forward(x(i), x(i + 1));
    notify(on_block_use, i, block_use::after_forward);
  }
  norm_cur_ = planned_view(norm_out_, bt, "llama", "norm_out");
  norm_.forward(x(cfg_.n_layer), norm_cur_);
  logits_cur_ = planned_view(logits_, {b_ * t_, cfg_.vocab}, "llama", "logits");
  ops::matmul(norm_cur_.reshape({b_ * t_, cfg_.dim}), head_weight().transpose(0, 1), logits_cur_);
  return loss_.forward(logits_cur_, targets.reshape({b_ * t_}));
}

void llama::backward(double loss_scale) {
  TROUPE_CHECK(b_ > 0, "llama: backward called before forward");
  shape bt{b_, t_, cfg_.dim};
  tensor dlogits = logits_cur_;  // overwritten in place
  loss_.backward(dlogits, loss_scale);
  tensor da = planned_view(dx_a_, bt, "llama", "dx_a");
  tensor db = planned_view(dx_b_, bt, "llama", "dx_b");
  tensor hn = norm_cur_.reshape({b_ * t_, cfg_.dim});
  // Head: dW += dlogits^T norm_out; dnorm_out = dlogits W (W is embed_tokens' when tied).
  ops::matmul(dlogits.transpose(0, 1), hn, head_grad(), 1.0, 1.0);
  ops::matmul(dlogits, head_weight(), da.reshape({b_ * t_, cfg_.dim}));
  norm_.backward(da, db);
  auto x = [&](std::int64_t i) { return planned_view(x_[i], bt, "llama", "x"); };
  for (std::int64_t i = cfg_.n_layer - 1; i >= 0; --i) {
    notify(on_block_use, i, block_use::before_backward);
    // The last block's activations are still those of the forward.
    if (cfg_.recompute && i + 1 < cfg_.n_layer) layers_[i].recompute(x(i));
    layers_[i].backward(db, da);
    if (on_block_grads) on_block_grads(i);
    notify(on_block_use, i, block_use::after_backward);
    std::swap(da, db);
  }
  embed_tokens_.backward(db);
}

void llama::begin_generation(std::int64_t batch, std::int64_t capacity) {
  if (capacity == 0) capacity = cfg_.max_seq;
  TROUPE_CHECK(batch > 0 && batch <= dims_.batch, "llama: generation batch ", batch,
               " must be in 1..", dims_.batch, " (the planned batch)");
  TROUPE_CHECK(capacity > 0 && capacity <= cfg_.max_seq, "llama: generation capacity ", capacity,
               " must be in 1..", cfg_.max_seq, " (max_seq)");
  if (cache_ && cache_->dims().batch == batch && cache_->dims().capacity == capacity) {
    cache_->clear();
    return;
  }
  cache_.reset();  // free the old cache before planning the new one
  cache_ = std::make_unique<kv_cache>(cfg_.n_layer,
                                      kv_cache_dims{.batch = batch,
                                                    .capacity = capacity,
                                                    .n_kv_head = cfg_.n_kv_head,
                                                    .head_dim = cfg_.head_dim},
                                      dtype_, dev_);
}

tensor llama::step_logits(const tensor& ids) {
  TROUPE_CHECK(cache_ != nullptr, "llama: step_logits called before begin_generation");
  check_ids(ids, "ids");
  std::int64_t b = ids.size(0), t = ids.size(1), start = cache_->length();
  TROUPE_CHECK(b <= cache_->dims().batch && t <= dims_.seq, "llama: step [", b, ", ", t,
               "] exceeds the generation batch ", cache_->dims().batch, " or the planned seq ",
               dims_.seq);
  cache_->check_room(t, "llama");
  shape bt{b, t, cfg_.dim};
  auto x = [&](std::int64_t i) { return planned_view(x_[i], bt, "llama", "x"); };
  embed_tokens_.forward(ids, x(0));
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i)
    layers_[i].forward_step(x(i), x(i + 1), cache_->layer(i), start);
  tensor hn = planned_view(norm_out_, bt, "llama", "norm_out");
  norm_.forward(x(cfg_.n_layer), hn);
  tensor out = planned_view(logits_, {b, cfg_.vocab}, "llama", "logits");
  ops::matmul(hn.select(1, t - 1), head_weight().transpose(0, 1), out);
  cache_->advance(t);
  return out;
}

}  // namespace troupe::models
