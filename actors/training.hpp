// Hybrid-parallel training as actors: a "trainer" role actor on every rank holds that rank's piece
// of the run (models/parallel/hybrid.hpp: its pipeline stage and/or tensor shard, its ZeRO shard),
// and a driver - the coordinator side of an actor script, on rank 0 - tells them what to do step by
// step and gathers what they report:
//
//   setup{config}   every trainer builds its communicators (groups of the plan's rank grid, over
//                   the node's UCX transport), its piece and the data-parallel engine
//   step{k}         every trainer runs step k; activations and gradients move rank to rank over
//                   UCX (pipeline sends, tensor and data-parallel collectives), never through the
//                   driver; each replies step_done{loss, tokens, seconds, bubble, ...}
//   save{dir}       the weights (parameter by parameter) and AdamW's moments (in windows) are
//                   gathered from the pieces and rank 0 streams them into the single-process
//                   trainer's folder (HF weights, optimizer.safetensors,
//                   trainer_state.json; every checkpoint.every steps and after the last); with
//                   checkpoint.resume, setup reads each rank's parts and the run continues from
//                   the saved step under any plan
//
// Trainers report their mesh coordinates, activity and metrics to introspection (troupe ps/top).
// With expert parallelism (parallel.ep > 1) the driver also spawns an expert-group actor on every
// rank (expert_group.hpp), which each trainer tells its experts' load after every step.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "actors/elastic_policy.hpp"
#include "actors/node.hpp"
#include "actors/roles.hpp"
#include "models/hf/config.hpp"
#include "models/parallel/grad_producer.hpp"
#include "models/train_config.hpp"
#include "models/train_loop.hpp"
#include "models/trainer.hpp"

namespace troupe::actors {

// Registers the "trainer" role.
void add_trainer_role(role_registry& roles);

// Post-training under a plan (troupe sft launched): the trainers train `model` (instead of the
// job's model.size / model.hf config: the command sizes the vocabulary to its chat template's
// special tokens) on the samples `make` returns for the run's train_config (instead of its
// pretraining data), each rank making its own from the same file and settings (the samples are a
// pure function of them, so every rank sees the same stream). Elastic runs are refused by name.
struct trainer_samples {
  models::hf::model_config model;
  std::function<models::parallel::sample_source(const models::train_config&)> make;
};

// Registers the "trainer" role training on `samples`.
void add_trainer_role(role_registry& roles, trainer_samples samples);

// What the driver learns from one step.
struct step_report {
  models::step_result result;  // loss, grad norm, lr, tokens, seconds (the slowest rank's)
  double bubble = 0;           // pipeline idle share (the largest over the stages)
  double comm_wait = 0;        // seconds waiting for gradient collectives (the largest)
  double all_to_all = 0;       // parallel.ep > 1: seconds in the MoE all-to-alls (the largest)
};

struct training_summary {
  // The loop's totals (models/train_loop.hpp): progress.step is the step reached (a resumed run
  // counts its checkpoint's steps too); ran, tokens, seconds and the losses are of the steps run
  // here (the slowest rank's seconds per step).
  models::train_progress progress;
  std::vector<std::string> ranks;  // one line per rank: "rank 1: dp 0 pp 1 tp 0, stage 1 of 2 ..."
  std::string checkpoint;          // where the whole model was written ("" when not)
  // One line per rank at the end of the run: the most parameter bytes it held at once against the
  // whole model's, its peak host buffer bytes and its peak RSS (VmHWM).
  std::vector<std::string> memory;
  int recoveries = 0;  // elastic: lost ranks replaced
  int joiners = 0;     // elastic: joiners (troupe launch --join) admitted as spares
  int growths = 0;     // elastic: growths back to a larger plan
  // Elastic buddy replicas (elastic.replica_interval): rounds completed, the driver's seconds in
  // them (both phases, asked of every rank and answered), and the most bytes a rank sent in one.
  int replications = 0;
  double replication_seconds = 0;
  std::int64_t replication_bytes = 0;
};

struct drive_options {
  std::function<void(const std::vector<std::string>& ranks)> on_setup;  // once every rank is ready
  std::function<void(const step_report&)> on_step;
  // After each checkpoint save: the step saved, the folder, and the step it held before (if any).
  std::function<void(std::int64_t step, const std::string& folder,
                     std::optional<std::int64_t> held)>
      on_save;
  // Elastic runs: one line per recovery (what was lost, in which step and phase, who took its
  // place, where its state came from, how long it took) and one when the first step after it
  // completes.
  std::function<void(const std::string& line)> on_recovery;
  std::chrono::milliseconds step_timeout{600000};
  // Elastic runs: a role (registered on the driver's rank) whose actor decides at membership
  // events (actors/elastic_policy.hpp); empty: the settings decide.
  std::string policy_role;
};

// On the driver rank: spawns a trainer on every rank, sets them up with `cfg` (its plan's degrees
// must multiply to the world size), runs the steps up to cfg.steps on the one training loop
// (models/train_loop.hpp: each step asked of every trainer, the first rank's loss, the slowest
// rank's seconds) and, when cfg.ckpt_dir is set, writes the whole model there in HF layout
// (config.json, safetensors, troupe_parallel.json with the step and plan) every cfg.ckpt_every
// steps and at the end; rank 0 checks at setup that it can write there.
// Throws an error naming the rank when a trainer fails: the first failure ends the wait for the
// others (which may be blocked on the failed one) and the trainers are stopped.
//
// Elastic runs (cfg.elastic(): elastic.enabled or elastic.spares; docs/adr/0005): the job has
// cfg.elastic_spares ranks beyond the plan's, whose trainers hold no piece. Each step runs in two
// phases, prepare on every trainer (forward, backward, gradient collectives) then commit (the
// optimizer step, the commit point; local for ZeRO 0), so a step is applied by every rank or by
// none. When a rank holding a piece is lost, every survivor's communicators fail at once (the
// trainers watch the membership), the driver asks the survivors which step they hold (they must
// agree on the last committed one), gives the lost grid position to a spare at a new generation
// (new communicators under the pieces, whose group ids carry the generation), has a surviving
// data-parallel replica of the same piece send it the parameters and AdamW moments over UCX, and
// runs the abandoned step again: the losses and weights are the fault-free run's, bit for bit.
// Pieces without a data-parallel replica (dp 1) and ZeRO 1-3 shards come back from buddy
// replicas (elastic.replica_interval). Without a spare, or without a copy of the lost piece (no
// replica, or a rank and its buddy both lost), it throws naming the lost rank (and its buddy),
// the step and the last committed step.
training_summary drive_training(node& n, const models::train_config& cfg,
                                const drive_options& o = {});

}  // namespace troupe::actors
