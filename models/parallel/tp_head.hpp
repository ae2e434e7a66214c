// tp_head: the back of a tensor shard (and of a pipeline's last stage), for every family whose head
// is a final norm, a linear head without bias and the mean cross-entropy (GPT-2: ln_f and the tied
// wte; Llama: norm and lm_head, or embed_tokens when tied):
//
//   logits = norm(x) @ W^T on the shard's vocabulary rows of W [V/tp, C] (SP: norm's output on
//            the shard's T/tp rows, gathered before the head), loss = vocab-parallel cross-entropy
//            (tp_vocab.hpp: the same on every shard).
//
// W is declared by declare (a scope's "weight", split by rows; an embedding's copy when the head is
// tied) or bound by the owner to the front's token embedding. With tp_group{} (no communicator) it
// is the unsharded head. Norm: layernorm or rmsnorm (instantiated in tp_head.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/layers/layernorm.hpp"
#include "models/layers/rmsnorm.hpp"
#include "models/parallel/tp_layers.hpp"
#include "models/parallel/tp_vocab.hpp"
#include "models/token_objective.hpp"

namespace troupe::models {

template <class Norm>
struct tp_head {
  struct config {
    std::int64_t dim = 0, vocab = 0;  // the unsharded sizes
    typename Norm::config norm;
    bool tied = false;  // W is the token embedding (a declared W is the embedding's copy)
    // The names of the norm and of its output activation: "ln_f", "ln_f_out" (GPT-2).
    std::string norm_name = "norm", norm_out_name = "norm_out";
  };
  config cfg;
  tp_group tp;
  sp_norm<Norm> norm;
  tp_entry entry;
  vocab_parallel_cross_entropy loss;
  tensor weight, dweight;  // [V/tp, C]: declared by declare (weight_scope) or bound by the owner
  // A per-token objective (models/token_objective.hpp) for the forwards that follow: forward
  // returns its loss (every shard calls it with the same log-probabilities) and backward its
  // gradient (loss.row_weights). Empty: the mean cross-entropy.
  token_objective objective;

  tp_head(const config& c, tp_group g);
  std::int64_t local_vocab() const { return loss.local_vocab; }
  // Declares the norm, "<weight_scope>.weight" (unless weight_scope is empty), the entry (scope
  // "head") and the activations.
  void declare(slot_list& s, batch_dims b, std::string_view weight_scope);
  // x [B, T, C] (SP: [B, T/tp, C]), targets [B, T] -> the mean loss.
  double forward(const tensor& x, const tensor& targets);
  tensor logits() const { return logits_cur_; }  // [B*T, V/tp]
  // d(loss_scale * loss)/d(x) into dx (shaped like x), scratch another such buffer; accumulates
  // the weight's and the norm's gradients.
  void backward(double loss_scale, const tensor& scratch, const tensor& dx);
  // A generation step's head: x [B, t, C] whole on every shard (also with SP) -> the shard's
  // vocabulary columns of the last position into logits [B, V/tp]. Overwrites the activations of
  // the last forward.
  void last_logits(const tensor& x, const tensor& logits);

 private:
  tensor norm_out_, logits_, norm_cur_, logits_cur_;
  std::int64_t b_ = 0, t_ = 0;
};

extern template struct tp_head<layernorm>;
extern template struct tp_head<rmsnorm>;

}  // namespace troupe::models
