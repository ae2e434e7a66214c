// reward_model: a scalar head on the trunk, HF's LlamaForSequenceClassification /
// GPT2ForSequenceClassification with num_labels 1: the reward of a row is score.weight [1, C]
// applied to the final (normed) hidden state of its pooled token, which is HF's: the token before
// the first pad_token_id of the row (the last one when it has none).
//
// Built as the family's causal LM with one output row more: the head's row V (V the HF vocabulary)
// is score.weight, so the trunk's forward gives every position's score in logits column V, and
// the head's backward takes d reward / d score through trunk::set_logit_grads (only column V of
// the pooled rows is nonzero, so the head's other rows, and the token embedding's row V, which no
// id looks up, get no gradient). With a tied head (GPT-2) the score is the token embedding's row V.
//
// Checkpoints are HF's layout and names: the trunk's tensors under the CausalLM names without
// lm_head, the embedding's first V rows, and score.weight; config.json says
// ...ForSequenceClassification with num_labels 1 and pad_token_id. load reads such a folder (HF's
// own or one saved here).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <vector>

#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/config.hpp"

namespace troupe::models {

class reward_model {
 public:
  // cfg: the HF config (its vocabulary V; GPT-2 or Llama, a mixture of experts is refused);
  // dims: the planned batch of rows.
  reward_model(const hf::model_config& cfg, batch_dims dims, std::int32_t pad_id,
               dtype t = dtype::f32);

  causal_lm& lm() { return *lm_; }  // the trunk with its V + 1 rows (memory, trainer)
  std::int64_t vocab() const { return vocab_; }

  // ids i32 [B, T] on the host: the rewards of the rows. Keeps what backward needs.
  std::vector<double> forward(const tensor& ids);
  // Accumulates d(loss_scale * sum_b drewards_b * reward_b) / d params into the gradients.
  void backward(std::span<const double> drewards, double loss_scale = 1.0);

  // HF layout (model.safetensors, config.json) into an existing folder.
  expected<std::filesystem::path> save(const std::filesystem::path& folder) const;
  // The weights of an HF ...ForSequenceClassification folder; errors name the file and tensor.
  // With need_score false a folder without score.weight (a causal LM's: TRL starts a reward model
  // from one) leaves the score as it is (initialised).
  expected<std::filesystem::path> load(const std::filesystem::path& folder, bool need_score = true);

 private:
  hf::model_config cfg_;  // HF's (vocabulary V)
  std::int64_t vocab_ = 0, t_ = 0;
  std::int32_t pad_;
  std::unique_ptr<causal_lm> lm_;
  std::vector<std::int32_t> targets_;  // all ignored: the loss is not used
  std::vector<std::int64_t> pooled_;   // per row: the flat row of its pooled token
};

// HF's pooled position of each row of ids [B, T] (host i32): the first pad_id's position - 1,
// modulo T.
std::vector<std::int64_t> pooled_positions(const tensor& ids, std::int32_t pad_id);

}  // namespace troupe::models
