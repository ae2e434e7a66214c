// plan_samples: the post-training steps (SFT, DPO, GRPO) as sample sources of the parallel engine
// (models/parallel/grad_producer.hpp: sample_source), so `hybrid_trainer::step(samples)` trains
// them under any dp x pp x tp plan with the single-process step's numbers (sft_step.hpp,
// dpo_step.hpp, grpo_step.hpp at the same rows). Sample i of the run's stream is the row the
// single-process trainer reads as row i mod batch of draw i / batch; each microbatch's loss and
// d loss / d logp per token come from the single-process loss code (dpo_loss, grpo_loss) as a
// token objective (models/token_objective.hpp), evaluated where the logits are.
//
//   SFT   mean cross-entropy over the assistant tokens, the microbatch weighed by its share of
//         the step's assistant tokens (as sft_micro_batch); `packed` passes the rows' segments
//         and positions, which every piece honours (a whole model, a tensor shard's heads and
//         GPT-2 front, each pipeline stage's chunks), else one conversation per row is assumed
//         (sft_options::pack = false).
//   DPO   sample 2j, 2j + 1: pair j's chosen and rejected rows (preference_rows' layout), so a
//         microbatch of an even number of rows holds whole pairs; the reference's sequence
//         log-probabilities are precomputed (dpo_reference_logprobs: the pieces hold no
//         reference model).
//   GRPO  sample i: row i mod rows of the batch (the single process trains on the whole batch
//         every step), with its old and reference log-probabilities and its advantage.
//   PPO   the policy's clipped objective (ppo_loss.hpp), sample i as GRPO's with its per-token
//         old log-probabilities and advantages; the loss is a token mean over the batch (TRL's
//         masked_mean), so a microbatch is weighed by its share of the batch's completion tokens.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/parallel/grad_producer.hpp"
#include "models/post/grpo_step.hpp"
#include "models/post/ppo_step.hpp"
#include "models/post/preference_data.hpp"
#include "models/post/preference_loss.hpp"
#include "models/post/sft_data.hpp"

namespace troupe::models {

// grad_accum: the step's draws (the plan's train_config.grad_accum; batch: its batch).
parallel::sample_source sft_samples(std::shared_ptr<const sft_rows> rows, std::int64_t batch,
                                    std::int64_t grad_accum, bool packed);

// The reference model's response log-probability of every row of `rows` (2 x pairs(); averaged
// over the response tokens for IPO, as dpo_forward), `reference` planned for [2, rows.seq].
std::vector<double> dpo_reference_logprobs(causal_lm& reference, const preference_rows& rows,
                                           const dpo_options& opt);

parallel::sample_source dpo_samples(std::shared_ptr<const preference_rows> rows,
                                    std::shared_ptr<const std::vector<double>> reference,
                                    const dpo_options& opt);

// What one GRPO microbatch's objective saw (grpo_samples' on_result): its first sample, its
// weight (rows over the step's), its result (kl and clip_ratio) and its completion tokens. A rank
// hears the microbatches whose logits it holds (every tensor shard of the last stage), a
// microbatch run again (recompute) once more.
struct grpo_microbatch_result {
  std::int64_t begin = 0;
  double weight = 0;
  grpo_result result;
  std::int64_t masked = 0;
};

parallel::sample_source grpo_samples(
    std::shared_ptr<const grpo_batch> batch, const grpo_options& opt,
    std::function<void(const grpo_microbatch_result&)> on_result = {});

// What one PPO microbatch's objective saw (ppo_samples' on_result): as grpo_microbatch_result,
// its weight being its share of the batch's completion tokens; entropy: the policy's mean entropy
// over its completion tokens (token_loss::on_entropy: on_result is called once the head gave it).
struct ppo_microbatch_result {
  std::int64_t begin = 0;
  double weight = 0;
  double loss = 0, clipfrac = 0, approx_kl = 0, entropy = 0;
};

// The policy's steps on `*batch` (its rows, old_logp and advantages; read at each call).
parallel::sample_source ppo_samples(
    std::shared_ptr<const ppo_batch> batch, const ppo_options& opt,
    std::function<void(const ppo_microbatch_result&)> on_result = {});

}  // namespace troupe::models
