// train_config: everything a single-process training run is told, from a TOML job file and/or
// command-line flags (flags win). Validated before anything starts; errors name the file and key
// (or the flag).
//
//   [model]       hf = "path/to/hf-folder"   # or: size = "gpt2-demo" | "gpt2-small" | "llama-tiny"
//   [data]        tokens = "train.tok"       # or: text = "/usr/share/games/fortunes" (bytes)
//   [train]       steps, batch, seq, grad_accum, seed, fixed_batch, recompute, log_every,
//                 precision, loss_scale, loss_scale_growth, device
//   [optim]       lr, min_lr, warmup, beta1, beta2, eps, weight_decay, clip, decay_exempt
//   [checkpoint]  dir, every, resume
//   [parallel]    dp, tp, pp, sp, zero, microbatches, schedule, virtual_stages, recompute,
//                 partition ("even" | "balanced": blocks per pipeline stage by a FLOP estimate),
//                 order (scheduler/plan.hpp). A step still reads train.batch x train.grad_accum
//                 samples: that global batch is split over parallel.dp ranks and
//                 parallel.microbatches. collective_timeout: seconds every collective and
//                 transfer of a launched run may take before it fails naming the ranks it waits
//                 for (default 600; 0: no deadline). dp_bucket_bytes (gradient buckets of the
//                 data-parallel reduction: bytes or "256K"; default 25M), dp_overlap (issue them
//                 during backward; default true), pipe_p2p ("async", the default, or "batched":
//                 how pipeline stages wait for transfers), pipe_trace (a path prefix: each stage
//                 appends every step's actions and their times to <prefix>.stage<s>.<pid>.txt;
//                 default "": none).
//   [memory]      device, host, nvme_dir, nvme_capacity, offload, offload_params,
//                 offload_optimizer, params_tier, optimizer_tier: training with memory tiers
//                 (models/offload). Sizes are integers (bytes) or strings with a suffix ("64M",
//                 "2G": K, M, G, T are powers of 1024). memory.device > 0 turns the tiers on; the
//                 other keys need it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "memory/error.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models {

struct train_config {
  // [model]
  std::string model_hf;                  // an HF folder (config.json + safetensors)
  std::string model_size = "gpt2-demo";  // a named size built from scratch
  // MoE models only (model.moe_capacity_factor): 0 routes dropless; > 0 caps each expert's rows
  // at ceil(factor x rows x top_k / experts) and drops the choices beyond (models/moe.hpp).
  double moe_capacity_factor = 0;
  // MoE models only (model.moe_aux_loss_coef): the router's load-balancing loss coefficient; < 0
  // keeps the model's (config.json's router_aux_loss_coef), 0 turns the aux loss off (as
  // output_router_logits false: the loss is then a mean over tokens, which a data- or
  // expert-parallel run reproduces exactly; each rank's aux loss is over its own rows).
  double moe_aux_loss_coef = -1;
  // [data]
  std::string data_tokens;                              // a token file (models/text)
  std::string data_text = "/usr/share/games/fortunes";  // byte-level text (file or folder)
  // [train]
  std::int64_t steps = 300, batch = 8, seq = 128, grad_accum = 1, log_every = 25;
  std::uint64_t seed = 1337;
  bool fixed_batch = false;
  bool recompute = false;  // activation checkpointing: run each block's forward again in backward
  // "f32"; "bf16": bf16 compute with f32 master weights; "f16": f16 compute with f32 master
  // weights and dynamic loss scaling (a step whose gradients overflow is skipped).
  std::string precision = "f32";
  // f16's dynamic loss scaling (models/loss_scaler.hpp): the initial scale (train.loss_scale,
  // --loss-scale) and the good steps in a row after which it doubles (train.loss_scale_growth,
  // --loss-scale-growth).
  double loss_scale = 65536.0;
  std::int64_t loss_scale_growth = 2000;
  // train.device (--device): "cuda" trains the single process on the first visible GPU (every
  // tensor on the device, the batch uploaded each step); "cpu"; "auto" (the default): the GPU when
  // the process sees one and the run is one the GPU path takes (one process, no memory tiers, not
  // elastic, not f64), else the CPU. Launched plans, tiers and elastic runs train on the CPU.
  std::string compute_device = "auto";
  // [optim]
  double lr = 3e-3, min_lr = 3e-4, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
  double clip = 1.0;
  std::int64_t warmup = 30;
  bool decay_exempt = false;  // exempt biases, norm weights and embeddings from weight decay
  // [checkpoint]
  std::string ckpt_dir;
  std::int64_t ckpt_every = 0;  // 0: only at the end (when ckpt_dir is set)
  std::string resume;           // a checkpoint folder written by troupe train
  // [parallel]: schedule = "gpipe" | "1f1b" | "eager-1f1b" | "zero-bubble" | "interleaved",
  // recompute = "none" | "selective" | "full", order = ["dp", "pp", "tp"] (slowest first); the rest
  // are integers, sp a bool.
  scheduler::parallel_plan plan;
  // parallel.collective_timeout (--collective-timeout): the deadline, in seconds, of every
  // collective and point-to-point transfer of a launched run (collective/communicator.hpp).
  // Generous: a slow but healthy rank never meets it. 0: none.
  double collective_timeout = 600;
  // parallel.pipe_trace (--pipe-trace): where pipeline stages append each step's trace
  // (models/parallel/pipeline_runner.hpp); "": no trace. Output, not a part of the plan: it
  // changes nothing the run computes.
  std::string pipe_trace;
  // [memory]: the tiers (models/offload/offload_trainer.hpp). All but device need device > 0.
  std::uint64_t mem_device = 0;         // device budget in bytes (0: no tiers)
  std::uint64_t mem_host = 0;           // host budget for chunks (0: unlimited)
  std::string mem_nvme_dir;             // the NVMe tier's directory ("": none)
  std::uint64_t mem_nvme_capacity = 0;  // limit on the NVMe tier's file (0: the disk's size)
  // "fixed" (the fractions below) or "auto" (measured in the first step); "": fixed when a
  // fraction is given, else auto.
  std::string mem_offload;
  double mem_offload_params = -1;     // fixed: fraction of parameter chunks offloaded (-1: 0)
  double mem_offload_optimizer = -1;  // fixed: fraction of optimizer-state chunks (-1: 1)
  // Where offloaded chunks live: "host" or "nvme" ("": nvme when nvme_dir is given, else host).
  std::string mem_params_tier, mem_optimizer_tier;
  bool tiers() const { return mem_device > 0; }
  // [elastic] (actors/training.hpp, a launched run): enabled (--elastic) makes the optimizer step
  // the commit point of every step and turns the loss of a rank into a recovery instead of the
  // job's end; spares (--spares; `troupe launch --spares S` passes its S): ranks started beyond
  // the plan's, idle until one takes a lost rank's place (spares > 0 implies enabled);
  // chaos_kill (--chaos-kill "RANK:STEP:PHASE[,...]", a drill): the process of rank RANK kills
  // itself (SIGKILL) as step STEP (1-based) reaches PHASE: "forward" (before its forward pass),
  // "backward" (at its first gradient reduction), "commit" (after every rank prepared the step,
  // before its optimizer step), "optimizer" (its AdamW ran, no reply sent) or "replicate" (during
  // the buddy copy after step STEP); several entries separated by commas (models/chaos_kills.hpp);
  // "": none.
  // replica_interval (--replica-interval K): every K steps each rank sends its piece state to its
  // buddy (the next grid position) and keeps a snapshot of its own, so a piece without a
  // data-parallel replica (dp 1, a stage or shard of dp 1, ZeRO 1-3) is restored from the buddy
  // and every rank goes back to that step; 0: no buddy replicas.
  // min_ranks (--min-ranks M; `troupe launch --min-ranks M` passes its M): with no spare left the
  // job shrinks onto the survivors (fewer data-parallel replicas, more micro-batches each: the
  // global batch kept) as long as the new plan has at least M ranks; 0 (the default): the full
  // plan, no shrinking. Implies enabled.
  // join_wait (--join-wait S): a rank lost with no spare left waits up to S seconds for a joiner
  // (troupe launch --join) to take its place before shrinking or ending the run; 0: no wait.
  // Joiners that arrive anyway become spares, and a shrunk run grows back to the larger plan at
  // the next step boundary when enough ranks are idle (docs/adr/0005, section 11).
  // await_join (--await-join STEP, a drill like chaos_kill): before step STEP (1-based) the
  // driver waits until a joiner arrived (up to join_wait seconds, 120 when 0); 0: no drill.
  double elastic_join_wait = 0;
  int elastic_await_join = 0;
  bool elastic_enabled = false;
  int elastic_spares = 0;
  int elastic_replica_interval = 0;
  std::string elastic_chaos_kill;
  int elastic_min_ranks = 0;
  bool elastic() const {
    return elastic_enabled || elastic_spares > 0 || elastic_replica_interval > 0 ||
           elastic_min_ranks > 0 || elastic_join_wait > 0;
  }

  // Checks ranges and combinations; the message names the key as "section.key".
  void validate() const;
  friend bool operator==(const train_config&, const train_config&) = default;
};

// Reads a TOML job file over the defaults; unknown sections or keys, wrong types and bad values
// are errors naming the file and "section.key". A file over 1 MiB is refused unread (toml++
// bounds the nesting of inline arrays and tables itself, at 256).
expected<train_config> load_train_config(const std::string& path);
// The same from TOML text; errors name `origin` as they would name the file.
expected<train_config> parse_train_config(std::string_view text, const std::string& origin);
// Every key as TOML: parse_train_config(to_toml(c)) == c (to hand a run's settings to other ranks
// or store them next to a checkpoint).
std::string to_toml(const train_config& c);

// Whether `c` trains on the GPU, given whether the process sees one: train.device = "cuda" (an
// error when none is visible, naming the key and flag), or "auto" and the run is one the GPU path
// takes.
bool trains_on_gpu(const train_config& c, bool gpu_visible, bool cuda_built = true);

// elastic.chaos_kill parsed: "3:5:forward" -> {3, 5, "forward"}; nullopt when malformed.
struct chaos_kill {
  int rank = -1;
  std::int64_t step = 0;  // 1-based
  std::string phase;      // models/chaos_kills.hpp's chaos_phases
};
std::optional<chaos_kill> parse_chaos_kill(std::string_view text);

// "1048576", "64K", "64M", "2G", "1T" (powers of 1024, an optional trailing "B" or "iB") to
// bytes; nullopt when it is not such a size.
std::optional<std::uint64_t> parse_byte_size(std::string_view text);

}  // namespace troupe::models
