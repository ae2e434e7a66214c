// train_loop: the one training loop of every mode. The single process (models/trainer.hpp), the
// memory tiers (models/offload/offload_trainer.hpp, stepped in place or through the tier-manager
// actor) and a launched hybrid run (actors/training.hpp: the driver stepping the trainer actors,
// each holding a models/parallel/hybrid.hpp piece) each bring a policy: how to run one step, how to
// save a checkpoint and what a failed step means. The loop owns the rest, the same for all:
//
//   steps        from the step the run starts at (0, or its resumed checkpoint's) to train.steps;
//                a step must report the step it completed (step_result::step = steps done before
//                it + 1), so a mode cannot skip or repeat one unnoticed
//   checkpoints  with checkpoint.dir, after every checkpoint.every-th step and after the last
//                (checkpoint_due); on_save hears the step saved, the folder and the step it held
//                before (hf::checkpoint_step, read just before the save)
//   progress     on_step after every step; the run's totals (train_progress) and the line that
//                closes every mode's log (trained_line)
//   stop         asked before each step: true ends the run there, after saving the last step run
//                (when checkpoint.dir is set and it is not saved yet)
//   failures     an exception from the step goes to the policy's `failed` with the progress so far
//                (e.g. to name the last checkpoint, or stop the other ranks), then on to the caller
//
// The model a run trains is chosen in one place too (model_config_of, model_label). The learning
// rate schedule and clipping are each a function the trainers share (models/optim.hpp:
// warmup_cosine_lr, clip_grad_norm), applied inside their step.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <optional>
#include <string>

#include "models/hf/config.hpp"
#include "models/train_config.hpp"
#include "models/trainer.hpp"

namespace troupe::models {

// The loop's totals so far.
struct train_progress {
  std::int64_t first = 0;  // the step the run started from (a resumed checkpoint's, else 0)
  std::int64_t step = 0;   // the steps done: first + ran
  std::int64_t ran = 0;    // steps run by this loop
  std::int64_t tokens = 0;
  double seconds = 0;                    // the steps' own seconds, summed
  double first_loss = 0, last_loss = 0;  // of the steps run by this loop
  std::int64_t saved = -1;               // the last step this loop checkpointed (-1: none)
  bool stopped = false;                  // a stop request ended the run before train.steps
};

// What a mode does for the loop.
struct train_policy {
  // Runs the step after `done` steps (0-based) and returns what it did.
  std::function<step_result(std::int64_t done)> step;
  // Writes the run's state (weights, optimizer, trainer state) into `folder`, replacing what a
  // checkpoint there held. Needed when checkpoint.dir is set.
  std::function<void(const std::string& folder)> save;
  // A step threw: called with the error and the progress before the step; may throw an error of
  // its own, else the step's error goes on. Optional.
  std::function<void(std::exception_ptr error, const train_progress& before)> failed;
};

// What the caller watches (all optional).
struct train_hooks {
  std::function<void(const step_result&)> on_step;
  std::function<void(std::int64_t step, const std::string& folder,
                     std::optional<std::int64_t> held)>
      on_save;
  std::function<bool()> stop;
};

// Runs steps first .. cfg.steps - 1 (0-based) through `policy`, checkpointing at the cadence.
train_progress run_train_loop(const train_config& cfg, std::int64_t first,
                              const train_policy& policy, const train_hooks& hooks = {});

// Whether the state after `step` (1-based) is checkpointed: checkpoint.dir is set and the step is
// a multiple of checkpoint.every (when > 0) or the last one, train.steps.
bool checkpoint_due(const train_config& cfg, std::int64_t step);

// "trained to step 300 in 33.5 s (9174 tokens/s); loss 5.560 -> 2.651": each mode's closing line
// starts so (and adds what it alone knows).
std::string trained_line(const train_progress& p);

// The model a run of cfg trains: checkpoint.resume's config.json, else model.hf's, else the named
// size model.size (its vocabulary from data.tokens when given). Throws naming the file or the size.
hf::model_config model_config_of(const train_config& cfg);
// Its name for the log: the folder it comes from, else the named size.
std::string model_label(const train_config& cfg);

// The single-process trainer's policy: tr.step(data); tr.save(folder, model). tr, model and data
// must outlive it.
train_policy trainer_policy(trainer& tr, const hf::model_config& model,
                            const trainer::batch_source& data);
// The same for a mode that brings its own micro-batch (SFT, DPO: models/post/): tr.step(run).
train_policy trainer_policy(trainer& tr, const hf::model_config& model,
                            const trainer::micro_batch& run);

}  // namespace troupe::models
