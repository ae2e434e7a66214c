// What a training run's checkpoint records of how it reads its data and schedules its learning
// rate (trainer_state.json's "extra"), and the checks a resume makes against it. Shared by the
// single-process trainer (models/trainer.cpp), the tiered one (models/offload/) and the plans'
// checkpoints (models/parallel/plan_checkpoint.hpp), so every checkpoint is refused for the same
// reasons with the same messages.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "memory/error.hpp"
#include "models/hf/training_state.hpp"
#include "models/train_config.hpp"

namespace troupe::models {

// What a run of cfg reads its data from, as the saved run's "data": "data.tokens <path>" or
// "data.text <path>", the path made absolute and canonical where it exists.
std::string data_identity(const train_config& cfg);

// trainer_state.json's "extra" for a run of cfg: the single-process trainer's keys (seed,
// precision, loss_scale, good_steps) and what positions the data and the learning-rate schedule
// (data_identity, train.batch, grad_accum, seq, fixed_batch; lr, min_lr, warmup, steps) and the
// plan it ran.
std::string run_extra_json(const train_config& cfg);

// Fails naming `file`, the setting (train.seed, the data, train.batch, grad_accum, seq,
// fixed_batch) and both values when the saved run (its extra_json) read its data differently from
// cfg, so step s would not read the batch it read there. Keys the file lacks (a checkpoint of an
// older build, or of the single-process trainer, which records the seed only) are not checked.
void check_data_position(const std::string& extra_json, const train_config& cfg,
                         const std::string& file);

// Fails naming train.steps (--steps), `folder` and the saved step unless saved_step < cfg.steps:
// a run resumed at or past its last step would train nothing and save nothing.
void check_steps_left(std::int64_t saved_step, const train_config& cfg, const std::string& folder);

// trainer_state.json's "extra" of a single-process run of cfg (this trainer's and
// models/offload's): what a parallel plan's checkpoint records (run_extra_json: seed, the data,
// batch, grad_accum, seq, fixed_batch, the learning-rate schedule, the plan) with the trainer's own
// keys (`own`, a JSON object) over it.
std::string run_state_extra(const train_config& cfg, const std::string& own);

// The saved state of the checkpoint in `folder` (moments of shape `moments`) if a run of cfg may
// resume it; else its error: the file at fault, or - when the saved run read its data differently,
// so step s would not read the batch it read there - trainer_state.json, the setting (train.seed,
// the data, train.batch, grad_accum, seq, fixed_batch, named with its flag) and both values.
// Checked before anything is loaded, for checkpoints of any plan.
expected<hf::training_state> resumable_state(const std::filesystem::path& folder,
                                             const train_config& cfg, const shape& moments);

}  // namespace troupe::models
