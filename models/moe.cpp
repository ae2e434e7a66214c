// moe: the MoE family's block, ends and checks, the trunk instantiated for it (moe.hpp).
#include "models/moe.hpp"

#include <string>
#include <unordered_map>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {

// The Llama config of the ends (and the attention's sizes).
llama_config as_llama(const moe_config& c) {
  return {.vocab = c.vocab,
          .dim = c.dim,
          .n_layer = c.n_layer,
          .n_head = c.n_head,
          .n_kv_head = c.n_kv_head,
          .head_dim = c.head_dim,
          .hidden = c.expert_hidden,
          .rms_eps = c.rms_eps,
          .rope_theta = c.rope_theta,
          .max_seq = c.max_seq,
          .tie_embeddings = c.tie_embeddings,
          .init_std = c.init_std};
}

}  // namespace

moe_config moe_family::checked(const moe_config& c) {
  TROUPE_CHECK(c.expert_hidden > 0,
               "moe: expert_hidden (intermediate_size / "
               "moe_intermediate_size) must be positive, got ",
               c.expert_hidden);
  TROUPE_CHECK(c.n_expert > 0 && c.top_k > 0 && c.top_k <= c.n_expert,
               "moe: n_expert (num_local_experts / num_experts) must be positive and top_k "
               "(num_experts_per_tok) in 1..n_expert, got ",
               c.n_expert, " and ", c.top_k);
  TROUPE_CHECK(c.shared_hidden >= 0 && c.capacity_factor >= 0 && c.router_aux_loss_coef >= 0,
               "moe: shared_hidden, capacity_factor and router_aux_loss_coef must be >= 0, got ",
               c.shared_hidden, ", ", c.capacity_factor, ", ", c.router_aux_loss_coef);
  const llama_config l = llama_family::checked(as_llama(c));
  moe_config r = c;
  r.n_kv_head = l.n_kv_head;
  r.head_dim = l.head_dim;
  return r;
}

moe_block::moe_block(const moe_config& c)
    : input_layernorm({.dim = c.dim, .eps = c.rms_eps}),
      post_attention_layernorm({.dim = c.dim, .eps = c.rms_eps}),
      self_attn({.dim = c.dim,
                 .n_head = c.n_head,
                 .n_kv_head = c.n_kv_head,
                 .head_dim = c.head_dim,
                 .fused_qkv = false,
                 .qkv_bias = c.qkv_bias,
                 .out_bias = false,
                 .rope = true,
                 .rope_theta = c.rope_theta}),
      mlp({.dim = c.dim,
           .hidden = c.expert_hidden,
           .n_expert = c.n_expert,
           .top_k = c.top_k,
           .norm_topk_prob = c.norm_topk_prob,
           .shared_hidden = c.shared_hidden,
           .capacity_factor = c.capacity_factor,
           .ep = c.ep,
           .ep_rank = c.ep_rank}) {}

moe_ends::moe_ends(const moe_config& c)
    : llama_ends(as_llama(c)), coef(c.router_aux_loss_coef), with_aux(c.aux_loss) {}

double moe_ends::head(const tensor& x, const tensor& targets) {
  const double ce = llama_ends::head(x, targets);
  // HF's load_balancing_loss_func over the layers' routers (moe.hpp).
  std::int64_t m = 0;
  std::vector<double> f, p;
  for (const moe_ffn* l : layers) {
    m += l->routing.rows;
    f.resize(l->routing.selected.size(), 0.0);
    p.resize(l->prob_sum.size(), 0.0);
    for (std::size_t e = 0; e < f.size(); ++e) {
      f[e] += static_cast<double>(l->routing.selected[e]);
      p[e] += l->prob_sum[e];
    }
  }
  aux = 0;
  if (m == 0) return ce;
  const double md = static_cast<double>(m);
  for (std::size_t e = 0; e < f.size(); ++e) aux += (f[e] / md) * (p[e] / md);
  aux *= static_cast<double>(f.size());
  return with_aux ? ce + coef * aux : ce;
}

void moe_ends::head_backward(double loss_scale, tensor& dx, tensor& spare) {
  // d(coef aux)/d p[n, e] = coef * n_expert * f_e / M for every row n of every layer.
  std::int64_t m = 0;
  std::vector<double> counts;
  for (const moe_ffn* l : layers) {
    m += l->routing.rows;
    counts.resize(l->routing.selected.size(), 0.0);
    for (std::size_t e = 0; e < counts.size(); ++e)
      counts[e] += static_cast<double>(l->routing.selected[e]);
  }
  for (moe_ffn* l : layers) {
    l->aux_dprob.clear();
    if (!with_aux || m == 0) continue;
    const double md = static_cast<double>(m), ne = static_cast<double>(counts.size());
    for (double c : counts) l->aux_dprob.push_back(loss_scale * coef * ne * c / (md * md));
  }
  llama_ends::head_backward(loss_scale, dx, spare);
}

void moe_family::connect(moe_ends& e, std::vector<moe_block>& blocks) {
  e.layers.clear();
  for (auto& b : blocks) e.layers.push_back(&b.mlp);
}

template class trunk<moe_family>;

moe::moe(const moe_config& cfg, batch_dims dims, dtype t, device dev)
    : trunk(cfg, dims, t, dev),
      mem_(cfg_.unbound ? layer_memory() : layer_memory(slots_, t, dev)) {}

void moe::init_weights(std::uint64_t seed) {
  init_values(seed, store_param);
}

void moe::init_values(std::uint64_t seed, const init_sink& each) const {
  if (cfg_.ep == 1) {
    draw_init(slots_, seed, cfg_.init_std, /*residual_scale=*/1.0, each);
    return;
  }
  // The whole model's draws (its slots only: no memory), kept where this rank has the parameter.
  moe_config whole = cfg_;
  whole.ep = 1;
  whole.ep_rank = 0;
  whole.unbound = true;
  const moe full(whole, {1, 1});
  std::unordered_map<std::string, const tensor_slot*> mine;
  for (const auto& s : slots_.slots())
    if (s.kind == slot_kind::param) mine.emplace(s.name, &s);
  draw_init(full.slots_, seed, cfg_.init_std, /*residual_scale=*/1.0,
            [&](const tensor_slot& s, const tensor& values) {
              if (auto it = mine.find(s.name); it != mine.end()) each(*it->second, values);
            });
}

void moe::set_expert_exchange(moe_exchange* x) {
  for (moe_ffn* l : ends().layers) l->exchange = x;
}

moe_load moe::load() const {
  moe_load r;
  for (const moe_ffn* l : ends().layers) {
    r.selected.resize(l->routing.selected.size(), 0);
    for (std::size_t e = 0; e < r.selected.size(); ++e) r.selected[e] += l->routing.selected[e];
    r.dropped += l->routing.dropped;
    r.first_expert = l->first_expert();
    r.served.resize(l->served.size(), 0);
    for (std::size_t j = 0; j < r.served.size(); ++j) r.served[j] += l->served[j];
    r.choices += l->routing.rows * l->routing.top_k;
  }
  return r;
}

}  // namespace troupe::models
