// tp_llama: the tensor-parallel Llama and parallelize_llama (see parallelize_llama.hpp).
#include "models/parallel/parallelize_llama.hpp"

#include <string>

#include "memory/error.hpp"
#include "models/parallel/param_slices.hpp"
#include "models/parallel/tp_compose.hpp"
#include "models/targets.hpp"

namespace troupe::models {

tp_llama::tp_llama(const llama_config& cfg, batch_dims dims, tp_group tp)
    : cfg_(resolve_tp_llama_config(cfg, tp, "tp_llama")),
      dims_(dims),
      tp_(tp),
      embed_tokens_({.vocab = cfg_.vocab, .dim = cfg_.dim}, tp),
      head_(cfg_, tp) {
  TROUPE_CHECK(dims.batch > 0 && dims.seq > 0 && dims.seq <= cfg_.max_seq, "tp_llama: the planned ",
               "batch [", dims.batch, ", ", dims.seq, "] must be positive with seq <= max_seq (",
               cfg_.max_seq, ")");
  const shape bt = shard_rows(dims, cfg_.dim, tp, "tp_llama");
  layers_.reserve(cfg_.n_layer);
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i) layers_.emplace_back(cfg_, tp);
  x_.resize(cfg_.n_layer + 1);

  embed_tokens_.declare(slots_, "embed_tokens", dims);
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i) {
    slots_.activation("x." + std::to_string(i), bt, x_[i]);
    const auto mark = slots_.mark_block(i);
    layers_[i].declare(slots_, "layers." + std::to_string(i), dims, cfg_.recompute);
  }
  slots_.activation("x." + std::to_string(cfg_.n_layer), bt, x_[cfg_.n_layer]);
  head_.declare(slots_, dims, cfg_.tie_embeddings ? "" : "lm_head");
  slots_.scratch("dx_a", bt, dx_a_);
  slots_.scratch("dx_b", bt, dx_b_);
  mem_ = layer_memory(slots_, dtype::f32, device::cpu());
  if (cfg_.tie_embeddings) {
    head_.weight = embed_tokens_.weight;
    head_.dweight = embed_tokens_.dweight;
  }
}

void tp_llama::load_from(const slot_list& full, bool from_grads, bool to_grads) {
  copy_slices_by_name(slots_, full, from_grads, to_grads, /*into_piece=*/true, tp_, "tp_llama");
}

void tp_llama::init_weights(std::uint64_t seed) {
  llama_config whole = cfg_;
  whole.unbound = true;
  const llama full(whole, {1, 1});
  init_slices([&](const init_sink& each) { full.init_values(seed, each); }, slots_, tp_,
              "tp_llama");
}

double tp_llama::forward(const tensor& ids, const tensor& targets) {
  const batch_dims got = checked_batch(ids, targets, dims_, "tp_llama");
  b_ = got.batch;
  t_ = got.seq;
  const shape bt = shard_rows(got, cfg_.dim, tp_, "tp_llama");
  auto x = [&](std::int64_t i) { return planned_view(x_[i], bt, "tp_llama", "x"); };
  embed_tokens_.forward(ids, x(0));
  for (std::int64_t i = 0; i < cfg_.n_layer; ++i) {
    notify(on_block_use, i, block_use::before_forward);
    layers_[i].forward(x(i), x(i + 1));
    notify(on_block_use, i, block_use::after_forward);
  }
  return head_.forward(x(cfg_.n_layer), targets);
}

void tp_llama::backward(double loss_scale) {
  TROUPE_CHECK(b_ > 0, "tp_llama: backward called before forward");
  const shape bt = shard_rows({b_, t_}, cfg_.dim, tp_, "tp_llama");
  auto x = [&](std::int64_t i) { return planned_view(x_[i], bt, "tp_llama", "x"); };
  tensor da = planned_view(dx_a_, bt, "tp_llama", "dx_a");
  tensor db = planned_view(dx_b_, bt, "tp_llama", "dx_b");
  head_.backward(loss_scale, da, db);
  for (std::int64_t i = cfg_.n_layer - 1; i >= 0; --i) {
    notify(on_block_use, i, block_use::before_backward);
    // The last block's activations are still those of the forward: the head's buffers are not
    // the blocks' shared activation bytes (top-level activations, scratch in its own arena).
    if (cfg_.recompute && i + 1 < cfg_.n_layer) layers_[i].recompute(x(i));
    layers_[i].backward(db, da);
    notify(on_block_use, i, block_use::after_backward);
    std::swap(da, db);
  }
  embed_tokens_.backward(db);
}

void tp_llama::begin_generation(std::int64_t batch, std::int64_t capacity) {
  const auto& a = layers_[0].self_attn.local.cfg;  // the shard's heads
  begin_tp_generation(gen_,
                      {.n_layer = cfg_.n_layer,
                       .batch = batch,
                       .capacity = capacity,
                       .n_kv_head = a.n_kv_head,
                       .head_dim = a.head_dim,
                       .vocab = cfg_.vocab,
                       .rows = shard_rows(dims_, cfg_.dim, tp_, "tp_llama")[1],
                       .max_batch = dims_.batch,
                       .max_step = dims_.seq,
                       .max_seq = cfg_.max_seq},
                      tp_, "tp_llama");
}

tensor tp_llama::step_logits(const tensor& ids) {
  TROUPE_CHECK(gen_ != nullptr, "tp_llama: step_logits called before begin_generation");
  const std::int64_t b = ids.dim() == 2 ? ids.size(0) : 0;
  auto x = [&](std::int64_t i, std::int64_t n) {
    return planned_view(x_[i], {b, n, cfg_.dim}, "tp_llama", "x");
  };
  const std::int64_t n = gen_->run(ids, "tp_llama", [&](const tensor& part, std::int64_t start) {
    const std::int64_t t = part.size(1);
    embed_tokens_.forward_full_sequence(part, x(0, t));
    for (std::int64_t i = 0; i < cfg_.n_layer; ++i)
      layers_[i].forward_step(x(i, t), x(i + 1, t), gen_->layer(i), start);
  });
  head_.last_logits(x(cfg_.n_layer, n), gen_->local_logits(b));
  return gen_->gather(b);
}

std::unique_ptr<tp_llama> parallelize_llama(const llama& model, batch_dims dims,
                                            collective::communicator& tp, bool sequence_parallel) {
  auto m = std::make_unique<tp_llama>(model.config(), dims, tp_group{&tp, sequence_parallel});
  m->load_from(model);
  return m;
}

}  // namespace troupe::models
