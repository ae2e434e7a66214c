// gpt: a GPT-2-shaped language model composed of the layers (pre-LN blocks, learned positions,
// GELU-tanh MLP, tied head), with its memory planned before the first step.
//
//   x = wte[ids] + wpe[0..T-1]
//   for each block: r = x + attn(ln_1(x)); x = r + mlp(ln_2(r))
//   logits = ln_f(x) @ wte^T ; loss = mean cross-entropy(logits, targets)
//
// The model is plain: no rank logic. Parameters use the HF GPT-2 names (wte.weight,
// h.0.ln_1.weight, h.0.attn.qkv_proj.weight, ...); note that the projection weights are [out, in]
// as in torch nn.Linear (HF's Conv1D [in, out] layout is converted when checkpoints are loaded).
#pragma once

#include <cstdint>
#include <vector>

#include "models/layers/attention.hpp"
#include "models/layers/cross_entropy.hpp"
#include "models/layers/embedding.hpp"
#include "models/layers/layernorm.hpp"
#include "models/layers/mlp.hpp"
#include "models/layers/slots.hpp"

namespace troupe::models {

struct gpt_config {
  std::int64_t vocab = 256;
  std::int64_t max_seq = 64;
  std::int64_t dim = 64;
  std::int64_t n_layer = 2;
  std::int64_t n_head = 4;
  double ln_eps = 1e-5;
};

// r = x + attn(ln_1(x)); y = r + mlp(ln_2(r)), the pre-LN block of GPT-2 (with, as options,
// grouped-query heads and RoPE).
struct gpt_block {
  struct config {
    std::int64_t dim = 0, n_head = 0, n_kv_head = 0;  // n_kv_head 0: same as n_head
    bool rope = false;
    double ln_eps = 1e-5;
  };
  layernorm ln_1, ln_2;
  attention attn;
  mlp ff;
  tensor ln_1_out, attn_out, resid, ln_2_out, ff_out;  // activations [B, T, C]
  tensor dnorm, dresid;                                // backward scratch [B, T, C]

  explicit gpt_block(const config& c);
  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);
  void backward(const tensor& dy, const tensor& dx);  // dx may alias dy
};

class gpt {
 public:
  gpt(const gpt_config& cfg, batch_dims dims, dtype t = dtype::f32, device dev = device::cpu());
  gpt(const gpt&) = delete;
  gpt& operator=(const gpt&) = delete;

  const gpt_config& config() const { return cfg_; }
  const slot_list& slots() const { return slots_; }
  layer_memory& memory() { return mem_; }

  // GPT-2 initialisation: N(0, 0.02) weights, zero biases, unit norm weights, and the residual
  // projections scaled by 1/sqrt(2 n_layer); deterministic in the seed.
  void init_weights(std::uint64_t seed);

  // ids, targets: i32 [B, T] on the model's device (T <= max_seq, B <= the planned batch).
  // Returns the mean loss; keeps what backward needs.
  double forward(const tensor& ids, const tensor& targets);
  // Logits of the last forward, [B*T, V] (overwritten by backward).
  tensor logits() const { return logits_cur_; }
  // Accumulates d(loss)/d(params) into the gradients (zero them first with memory().zero_grads()).
  void backward();

 private:
  gpt_config cfg_;
  batch_dims dims_;
  embedding wte_, wpe_;
  std::vector<gpt_block> h_;
  layernorm ln_f_;
  cross_entropy_loss loss_;
  owned_tensor pos_ids_;                // i32 [max_seq]: 0..max_seq-1
  std::vector<tensor> x_;               // residual stream: x_[i] is the input of block i; [B, T, C]
  tensor pos_emb_, ln_f_out_, logits_;  // activations
  tensor dx_a_, dx_b_, dpos_;           // backward scratch [B, T, C]
  tensor logits_cur_, ln_f_cur_;
  std::int64_t b_ = 0, t_ = 0;
  slot_list slots_;
  layer_memory mem_;
};

}  // namespace troupe::models
