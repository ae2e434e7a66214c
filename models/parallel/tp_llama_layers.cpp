// Llama's tensor-parallel layers (see tp_llama_layers.hpp).
#include "models/parallel/tp_llama_layers.hpp"

#include "memory/error.hpp"
#include "models/parallel/param_slices.hpp"
#include "models/parallel/tp_compose.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

llama_config resolve_tp_llama_config(llama_config cfg, const tp_group& tp, std::string_view who) {
  const llama_config c = llama_family::checked(cfg);
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

}  // namespace troupe::models
