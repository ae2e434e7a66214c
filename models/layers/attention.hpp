// attention: causal self-attention with multi-head or grouped-query heads and optional RoPE.
//
//   q, k, v = projections of x          (one fused qkv_proj, GPT-2; or q/k/v_proj, Llama)
//   q, k    = rope(q), rope(k)          (optional; HF rotate-half convention, positions 0..T-1,
//                                        with HF's rope_scaling: models/layers/rope_scaling.hpp)
//   att     = softmax(q k^T * scale + causal mask) v   (ops::attention, flash-style, saves lse)
//   y       = o_proj(att)
//
// Layout: x, y [B, T, C]; q, att [B, T, Hq, D]; k, v [B, T, Hkv, D] with Hq % Hkv == 0. In the
// fused form the projection writes one [B, T, (Hq + 2 Hkv) D] buffer and q, k, v are views of it
// (the fused weight's rows are q heads, then k heads, then v heads). RoPE is applied in place, so
// the saved q and k are the rotated ones; backward applies the inverse rotation to their gradients.
// The cos/sin tables are scratch, recomputed in forward and in backward.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/layers/linear.hpp"
#include "models/layers/rope_scaling.hpp"
#include "models/layers/sequence_exchange.hpp"
#include "models/layers/sequence_ring.hpp"
#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct attention {
  struct config {
    std::int64_t dim = 0;        // model width C
    std::int64_t n_head = 0;     // query heads Hq
    std::int64_t n_kv_head = 0;  // key/value heads Hkv (0: same as n_head)
    std::int64_t head_dim = 0;   // D (0: dim / n_head)
    bool fused_qkv = true;       // qkv_proj [(Hq + 2 Hkv) D, C], or q_proj, k_proj, v_proj
    bool qkv_bias = true;
    bool out_bias = true;
    bool rope = false;
    double rope_theta = 10000.0;
    rope_scaling rope_scale{};  // HF's rope_scaling (none: plain RoPE)
    bool causal = true;
  };

  config cfg;
  std::string label = "attention";

  // Projections (only the ones the config uses are declared and bound).
  linear qkv_proj;                // fused: C -> (Hq + 2 Hkv) D
  linear q_proj, k_proj, v_proj;  // separate: C -> Hq D, Hkv D, Hkv D
  linear o_proj;                  // Hq D -> C (saves att)

  // Packed rows (several sequences per row): segment ids i32 [B, T] on the device, set by the
  // model before forward and kept intact until backward; a token attends only to the earlier
  // tokens of its segment (ops::attention_options::segments). Undefined: one sequence per row.
  // RoPE needs no per-sequence positions here: with the segment mask, scores depend only on the
  // distance between two tokens of one sequence, which a shift of both positions keeps.
  tensor segments;

  // Context parallelism (Ulysses, sequence_exchange.hpp; set by the placement, not owned): x and y
  // hold this rank's T/cp positions of each sample; q, k and v go to every position of H/cp heads
  // through the exchange, RoPE rotates them at positions 0..T-1, and the attention output comes
  // back before o_proj (ulysses_attention.cpp). Null: the whole sequence is here.
  sequence_exchange* exchange = nullptr;
  // Context parallelism (ring, sequence_ring.hpp; set by the placement, not owned): x and y hold
  // this rank's pieces of each sample (zigzag), RoPE rotates q and k at the pieces' global
  // positions, and the attention core runs over the whole sequence through the ring. Null: the
  // plain core.
  sequence_ring* ring = nullptr;

  // Saved by forward for backward (planned for the declared batch; a forward uses a prefix).
  tensor qkv;      // fused: [B, T, (Hq + 2 Hkv) D], holding q, k (rotated) and v
  tensor q, k, v;  // separate: [B, T, Hq, D], [B, T, Hkv, D], [B, T, Hkv, D]
  tensor att;      // [B, T, Hq, D], the attention output
  tensor lse;      // [B, Hq, T], log-sum-exp of each query's scores

  // Scratch, used inside one forward or backward call.
  tensor datt;                // [B, T, Hq, D]
  tensor dqkv;                // fused: like qkv
  tensor dq, dk, dv;          // separate: like q, k, v
  tensor rope_cos, rope_sin;  // [T, D / 2]

  attention() = default;
  explicit attention(const config& c);

  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);  // x, y [B, T, C]
  void backward(const tensor& dy, const tensor& dx);

 private:
  struct views {
    tensor q, k, v, dq, dk, dv;
  };
  views qkv_views(std::int64_t b, std::int64_t t, bool with_grads) const;
  void forward_exchanged(const tensor& x, const tensor& y);  // ulysses_attention.cpp
  void backward_exchanged(const tensor& dy, const tensor& dx);
  void rope_tables(std::int64_t t) const;
};

}  // namespace troupe::models
