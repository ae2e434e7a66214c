// cross_entropy_loss: the mean of -log softmax(logits)[target] over positions whose target is not
// ignore_index, and its gradient with respect to the logits.
//
// forward computes the per-position losses (saved) and returns the mean; backward recomputes the
// softmax row by row to write dlogits = (softmax - onehot) * dloss / count, which may alias the
// logits (saving the largest buffer of a language model; backward can then run only once).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct cross_entropy_loss {
  struct config {
    std::int64_t ignore_index = -100;
  };

  config cfg;
  std::string label = "cross_entropy_loss";

  // Saved by forward for backward.
  tensor logits, targets;  // views of the caller's tensors
  tensor losses;           // per position [rows] (planned; a forward uses a prefix)
  std::int64_t count = 0;  // positions not ignored in the last forward
  // Per-sequence weights for backward (empty: the mean). With w (one per sequence; the rows are
  // w.size() sequences of equal length, in order) backward writes the gradient of dloss * sum_b
  // w_b * (the summed losses of sequence b's rows): preference training, where w_b = -d loss /
  // d logp_b (models/post/dpo_step.hpp).
  std::vector<double> sequence_weights;
  // A head trained on its logits directly (a reward model's score: models/post/reward_model.hpp):
  // when set, backward calls it to write dlogits (scaled by dloss) instead of the cross-entropy's.
  std::function<void(const tensor& dlogits, double dloss)> logit_grads;

  cross_entropy_loss() = default;
  explicit cross_entropy_loss(const config& c) : cfg(c) {}

  void declare(slot_list& s, std::string_view name, batch_dims b);
  // logits [..., V] (floating), targets [...] (i32 or i64) -> mean loss (0 when all are ignored).
  double forward(const tensor& logits, const tensor& targets);
  // dlogits like logits = d(dloss * mean loss) / d logits.
  void backward(const tensor& dlogits, double dloss = 1.0);
};

}  // namespace troupe::models
