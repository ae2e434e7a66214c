// Vocabulary-parallel embedding and cross-entropy (Megatron's VocabParallelEmbedding and
// vocab_parallel_cross_entropy): shard r of tp owns the vocabulary rows r*V/tp .. (r+1)*V/tp - 1.
//
// vocab_parallel_embedding: each shard looks up the tokens it owns (the others give zero rows) and
// the rows are summed over the group (allreduce; with sequence parallelism reduce_scatter to the
// shard's [B, T/tp, C]). Backward scatters the (SP: gathered) output gradient into the shard's
// table for the tokens it owns.
// vocab_parallel_cross_entropy: the logits are the shard's columns [..., V/tp] (e.g. of a
// column-parallel head). The row maximum is allreduced (max), then the sum of exp(logit - max) and
// the target's logit (given by its owner, 0 elsewhere) are allreduced (sum), so every shard gets
// the same per-position losses; backward writes the gradient of the shard's logits only. With one
// shard (tp_group{}: a pipeline stage without tensor parallelism) both are the fused
// ops::cross_entropy, the single-process model's kernel (f32 statistics, vectorized exp): the f64
// loops above cost a pipeline's last stage about 5% of its compute on gpt2-demo.
// Both run on the host (the ids, targets and statistics are read by plain loops) in f32, f64 or
// bf16; with bf16 logits the cross-entropy's statistics and per-position losses are f32 and the
// logits' gradient is rounded once to bf16 (the single-process kernel's choice, tensor/ops.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "models/layers/embedding.hpp"
#include "models/layers/slots.hpp"
#include "models/parallel/tp_mappings.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct vocab_parallel_embedding {
  embedding::config cfg;  // the unsharded vocab and dim
  tp_group tp;
  std::string label = "vocab_parallel_embedding";
  std::int64_t vocab_start = 0, local_vocab = 0;

  tensor weight, dweight;           // [V/tp, dim]
  tensor ids;                       // saved: a view of the caller's ids
  tensor full, scratch, dy_masked;  // scratch: [B, T, dim] (SP), its buffer, [rows, dim]

  vocab_parallel_embedding() = default;
  vocab_parallel_embedding(const embedding::config& c, tp_group g);
  void declare(slot_list& s, std::string_view name, batch_dims b);
  // ids [B, T] (global token ids, i32 or i64, on the host) -> y [B, T, dim] (SP: [B, T/tp, dim]).
  void forward(const tensor& ids, const tensor& y);
  void backward(const tensor& dy);
  void load_from(const embedding& full);
  // forward without the sequence split whatever the group's sequence parallelism: y [B, t, dim]
  // whole on every shard (allreduced), as a generation step needs (tp_compose.hpp). Not for
  // training: backward expects forward's layout.
  void forward_full_sequence(const tensor& ids, const tensor& y);

 private:
  void lookup(const tensor& ids, const tensor& y, bool split);
  std::vector<std::int32_t> local_ids_;  // the shard's row of each id (0 if not owned)
  std::vector<std::pair<std::int64_t, std::int64_t>> foreign_;  // runs of rows not owned
  tensor local_ids_view(std::int64_t n);
  void zero_foreign(const tensor& rows) const;
};

struct vocab_parallel_cross_entropy {
  struct config {
    std::int64_t vocab = 0;  // the unsharded vocabulary
    std::int64_t ignore_index = -100;
  };
  config cfg;
  tp_group tp;
  std::string label = "vocab_parallel_cross_entropy";
  std::int64_t vocab_start = 0, local_vocab = 0;

  tensor logits, targets;  // saved views of the caller's tensors
  // Activations [2 rows]: the per-row statistics in the logits' dtype, or f32 for 16-bit logits
  // (in the first rows x 4 bytes); scratch [4 rows], the allreduce buffer.
  tensor row_max, sum_exp, losses;
  tensor scratch;
  std::int64_t count = 0;  // positions not ignored in the last forward
  // Per-position weights for backward (empty: the mean): with w (one per position of the last
  // forward) backward writes d(dloss * sum_n w[n] * loss_n) / d logits, a token objective's
  // gradient with w[n] = -d objective / d logp[n] (models/token_objective.hpp).
  std::vector<double> row_weights;

  vocab_parallel_cross_entropy() = default;
  vocab_parallel_cross_entropy(const config& c, tp_group g);
  void declare(slot_list& s, std::string_view name, batch_dims b);
  // logits [..., V/tp] (the shard's columns), targets [...] global ids -> mean loss over the
  // positions not ignored (the same on every shard).
  double forward(const tensor& logits, const tensor& targets);
  // dlogits [..., V/tp] = d(dloss * mean loss) / d(the shard's logits) (with row_weights, of
  // the weighted sum); may alias logits.
  void backward(const tensor& dlogits, double dloss = 1.0);
  // The last forward's log-probability of each target, -loss_n (0 where ignored), the same on
  // every shard.
  std::vector<double> token_logprobs() const;
};

}  // namespace troupe::models
