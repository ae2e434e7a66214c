// troupe train: training of a GPT-2 or Llama model from a TOML job file and/or flags (flags win;
// see models/train_config.hpp). In one process it is the single-process trainer, the reference
// every parallel plan is compared with; started by `troupe launch -n N` it is one rank of a
// hybrid-parallel run (actors/training.hpp): rank 0 drives, every rank hosts a trainer actor.
#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "actors/bootstrap.hpp"
#include "actors/node.hpp"
#include "actors/training.hpp"
#include "apps/commands.hpp"
#include "apps/plan_flags.hpp"
#include "apps/sample_text.hpp"
#include "apps/train_tiers.hpp"
#include "memory/gpu.hpp"
#include "memory/tier.hpp"
#include "models/causal_lm.hpp"
#include "models/data_source.hpp"
#include "models/families.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/run_state.hpp"
#include "models/train_loop.hpp"
#include "models/trainer.hpp"
#include "tensor/parallel.hpp"

namespace troupe::apps {
namespace {

using models::train_config;
namespace hf = models::hf;

struct train_cli {
  train_config flags;  // values of the flags given
  std::vector<std::pair<CLI::Option*, void (*)(train_config&, const train_config&)>> applied;
  std::string config_file, json_path;
  bool demo = false;
  int threads = 0;
  sample_options sample;  // its seed is the run's train.seed
  // [parallel] flags (nested in train_config::plan, so bound by hand)
  plan_cli plan;  // --dp, --tp, ... (apps/plan_flags.hpp)
  std::vector<std::pair<CLI::Option*, std::function<void(train_config&)>>> plan_flags;
};

// Adds --name bound to flags.*field; when given, it overrides the job file. A bool field is a
// flag (--name, or --name=false).
template <auto Field>
void bind(train_cli& c, CLI::App* sub, const std::string& name, const std::string& help) {
  CLI::Option* opt = nullptr;
  if constexpr (std::is_same_v<std::remove_cvref_t<decltype(c.flags.*Field)>, bool>)
    opt = sub->add_flag(name, c.flags.*Field, help);
  else
    opt = sub->add_option(name, c.flags.*Field, help);
  opt->default_str(fmt::format("{}", train_config{}.*Field));
  c.applied.emplace_back(
      opt, [](train_config& to, const train_config& from) { to.*Field = from.*Field; });
}

class progress {
 public:
  progress(std::int64_t first, std::int64_t total, std::int64_t every, std::FILE* json)
      : tty_(::isatty(STDOUT_FILENO) != 0),
        first_(first),
        total_(total),
        every_(every),
        json_(json) {}
  void report(const models::step_result& r) {
    tokens_ += r.tokens;
    secs_ += r.seconds;
    double tps = tokens_ / std::max(secs_, 1e-9);
    // The loss and the gradient norm as the shortest text that reads back to the same double:
    // tests compare runs at the level of f32 rounding, and an f64 run's with its 16 digits.
    if (json_ != nullptr)
      fmt::print(json_,
                 "{{\"step\": {}, \"loss\": {}, \"grad_norm\": {}, \"lr\": {:.6g}, "
                 "\"loss_scale\": {}, \"skipped\": {}, \"tokens_per_s\": {:.1f}}}\n",
                 r.step, r.loss, r.grad_norm, r.lr, r.loss_scale, r.skipped, r.tokens / r.seconds);
    if (tty_) {
      double done = static_cast<double>(r.step - first_) / static_cast<double>(total_ - first_);
      int eta =
          static_cast<int>((total_ - r.step) * (secs_ / static_cast<double>(r.step - first_)));
      std::string bar(static_cast<std::size_t>(done * 30), '#');
      bar.resize(30, '.');
      fmt::print("\r[{}] step {}/{}  loss {:.4f}  {:.0f} tokens/s  ETA {}:{:02d} ", bar, r.step,
                 total_, r.loss, tps, eta / 60, eta % 60);
      if (r.step == total_) fmt::print("\n");
    } else if (r.step % every_ == 0 || r.step == total_ || r.step == first_ + 1) {
      fmt::print("step {:5d}/{}  loss {:.4f}  grad norm {:.3f}  lr {:.2e}  {:.0f} tokens/s\n",
                 r.step, total_, r.loss, r.grad_norm, r.lr, tps);
    }
    std::fflush(stdout);
  }

 private:
  bool tty_;
  std::int64_t first_, total_, every_;
  std::FILE* json_;
  double tokens_ = 0, secs_ = 0;
};

// --json: per-step JSON lines to a file, or to standard output for "-"; null when not asked.
std::unique_ptr<std::FILE, int (*)(std::FILE*)> open_json(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> json(nullptr, std::fclose);
  if (path.empty()) return json;
  json.reset(path == "-" ? fdopen(dup(STDOUT_FILENO), "w") : std::fopen(path.c_str(), "w"));
  TROUPE_CHECK(json != nullptr, "--json: cannot write ", path);
  return json;
}

// The log line of each checkpoint save (the loop's on_save).
void print_saved(std::int64_t step, const std::string& dir, std::optional<std::int64_t> held) {
  fmt::print("{}\n", hf::saved_line(dir, step, held));
  std::fflush(stdout);
}

// The checkpoint folder checked when the run is configured (hf::check_checkpoint_dir): the log
// line saying what it holds, or the refusal, naming the setting.
std::string checked_checkpoint_dir(const std::string& dir) {
  auto line = hf::check_checkpoint_dir(dir);
  if (!line) throw error("checkpoint.dir (--checkpoint-dir): " + line.error_message());
  return *line;
}

// One rank of a launched job: rank 0 drives the trainer actors of every rank.
int run_hybrid(train_cli& c, const train_config& cfg) {
  actors::role_registry roles;
  actors::add_trainer_role(roles);
  actors::node_options o;
  o.roles = &roles;
  // Survivors of an elastic run keep exchanging tensors after a local rank is lost.
  o.survive_local_loss = cfg.elastic();
  actors::node n(o);
  int rc = 0;
  if (n.rank() == 0) {
    fmt::print("troupe train: {} on {} ranks: {}\n",
               cfg.model_hf.empty() ? cfg.model_size : cfg.model_hf, n.world_size(),
               scheduler::describe(cfg.plan));
    auto json = open_json(c.json_path);
    std::optional<progress> bar;  // from the first step run: a resumed run starts past 0
    actors::drive_options d;
    d.on_setup = [](const std::vector<std::string>& ranks) {
      for (const auto& r : ranks) fmt::print("  {}\n", r);
      std::fflush(stdout);
    };
    double bubble = 0, wait = 0, all_to_all = 0, step_seconds = 0;
    d.on_step = [&](const actors::step_report& r) {
      if (!bar) bar.emplace(r.result.step - 1, cfg.steps, cfg.log_every, json.get());
      bar->report(r.result);
      bubble += r.bubble;
      wait += r.comm_wait;
      all_to_all += r.all_to_all;
      step_seconds += r.result.seconds;
    };
    d.on_save = print_saved;
    d.on_recovery = [](const std::string& line) {
      fmt::print("{}\n", line);
      std::fflush(stdout);
    };
    auto sum = actors::drive_training(n, cfg, d);
    const auto ran = static_cast<double>(sum.progress.ran);
    fmt::print(
        "{}; pipeline bubble {:.1f}% of the pipelined section; waiting for gradient collectives "
        "{:.2f} ms per step\n",
        models::trained_line(sum.progress), ran > 0 ? 100.0 * bubble / ran : 0.0,
        ran > 0 ? 1e3 * wait / ran : 0.0);
    if (cfg.plan.ep > 1 && ran > 0)
      fmt::print(
          "expert all-to-alls: {:.2f} ms per step, {:.1f}% of the step (the slowest rank's)\n",
          1e3 * all_to_all / ran, 100.0 * all_to_all / std::max(step_seconds, 1e-9));
    if (sum.replications > 0)
      fmt::print(
          "elastic: {} buddy replications ({:.2f} MB per rank at most), {:.3f} s in all, {:.1f}% "
          "on top of the steps' {:.3f} s\n",
          sum.replications, sum.replication_bytes / 1e6, sum.replication_seconds,
          sum.progress.seconds > 0 ? 100.0 * sum.replication_seconds / sum.progress.seconds : 0.0,
          sum.progress.seconds);
    for (const auto& m : sum.memory) fmt::print("  {}\n", m);
    if (!sum.checkpoint.empty()) {
      fmt::print(
          "checkpoint: {} (HF layout + optimizer state; --resume or --model-hf under any "
          "plan)\n",
          sum.checkpoint);
      if (c.sample.tokens > 0)
        fmt::print("sample from the checkpoint ({}):\n{}\n", sample_settings,
                   sample_checkpoint(sum.checkpoint, cfg.seq, c.sample));
    }
    std::fflush(stdout);
  }
  // Elastic: a lost rank fails the barrier for those waiting in it; the others wait again,
  // for as long as the driver (rank 0) is there.
  for (int attempt = 0;; ++attempt) {
    try {
      n.barrier("troupe train: done");
      break;
    } catch (const std::exception&) {
      if (!cfg.elastic() || !n.lost_reason(0).empty() || !n.lost_reason(n.rank()).empty() ||
          attempt >= n.world_size())
        throw;
    }
  }
  n.shutdown();
  return rc;
}

int run_train(train_cli& c) {
  train_config cfg;
  if (!c.config_file.empty()) cfg = models::load_train_config(c.config_file).value();
  for (auto& [opt, apply] : c.applied)
    if (opt->count() > 0) apply(cfg, c.flags);
  for (auto& [opt, apply] : c.plan_flags)
    if (opt->count() > 0) apply(cfg);
  // `troupe launch --spares S` tells its ranks S; the job file or --spares may say it too (they
  // must then agree with the ranks started: drive_training checks the world size).
  if (const char* spares = std::getenv("TROUPE_SPARES");
      spares != nullptr && cfg.elastic_spares == 0) {
    char* end = nullptr;
    const long v = std::strtol(spares, &end, 10);
    TROUPE_CHECK(end != spares && *end == '\0' && v >= 0 && v <= 1024,
                 "TROUPE_SPARES (set by troupe launch --spares) must be 0 to 1024, got '", spares,
                 "'");
    cfg.elastic_spares = static_cast<int>(v);
  }
  if (const char* min = std::getenv("TROUPE_MIN_RANKS");
      min != nullptr && cfg.elastic_min_ranks == 0) {
    char* end = nullptr;
    const long v = std::strtol(min, &end, 10);
    TROUPE_CHECK(end != min && *end == '\0' && v >= 0 && v <= 1 << 20,
                 "TROUPE_MIN_RANKS (set by troupe launch --min-ranks) must be a rank count, got '",
                 min, "'");
    cfg.elastic_min_ranks = static_cast<int>(v);
  }
  cfg.validate();
  c.sample.seed = cfg.seed;
  if (c.threads > 0) parallel::set_num_threads(c.threads);
  // Started by a launcher (troupe launch, Slurm, torchrun): one rank of a hybrid-parallel run.
  // Rank 0 writes the checkpoints: it checks their folder before it joins, so that a refusal
  // ends the job at once.
  // With memory tiers on several ranks the engine pages its ZeRO shard's optimizer state.
  if (auto join = actors::join_info_from_env();
      join.has_value() && (!cfg.tiers() || cfg.plan.world_size() > 1)) {
    if (join->rank == 0 && !cfg.ckpt_dir.empty())
      fmt::print("{}\n", checked_checkpoint_dir(cfg.ckpt_dir));
    return run_hybrid(c, cfg);
  }
  TROUPE_CHECK(cfg.plan.world_size() == 1,
               "parallel.dp x parallel.pp x parallel.tp = ", cfg.plan.world_size(),
               " ranks: start them with `troupe launch -n ", cfg.plan.world_size(),
               " -- troupe train ...`");
  // Before any work: a checkpoint folder a save could not replace without deleting the user's
  // files is refused now, not after the last step.
  if (!cfg.ckpt_dir.empty()) fmt::print("{}\n", checked_checkpoint_dir(cfg.ckpt_dir));

  // The model: resumed, loaded from an HF folder, or a named size from scratch.
  const hf::model_config mcfg = models::model_config_of(cfg);
  if (cfg.tiers()) {  // memory tiers: apps/cmd_train_tiers.cpp
    tiered_hooks h;
    h.model_label = models::model_label(cfg);
    auto json = std::make_shared<decltype(open_json(c.json_path))>(open_json(c.json_path));
    h.progress = [&cfg, json](std::int64_t first) {
      auto bar = std::make_shared<progress>(first, cfg.steps, cfg.log_every, json->get());
      return [bar](const models::step_result& r) { bar->report(r); };
    };
    h.on_save = print_saved;
    h.done = [&](models::causal_lm& m) {
      if (c.sample.tokens > 0)
        fmt::print("sample ({}):\n{}\n", sample_settings, sample_text(m, c.sample));
    };
    return run_tiered(cfg, mcfg, h);
  }
  const dtype compute = cfg.precision == "bf16"  ? dtype::bf16
                        : cfg.precision == "f16" ? dtype::f16
                        : cfg.precision == "f64" ? dtype::f64
                                                 : dtype::f32;
  const bool gpu = models::trains_on_gpu(cfg, memory::gpu_available(), memory::cuda_built());
  const device dev = gpu ? device::cuda() : device::cpu();
  auto model = models::make_causal_lm(mcfg, {cfg.batch, cfg.seq}, compute, dev,
                                      {.recompute = cfg.recompute});
  TROUPE_CHECK(cfg.seq <= model->max_seq(), "--seq ", cfg.seq, " exceeds the model's ",
               model->max_seq(), " positions");
  auto data =
      models::open_data_source(cfg.data_tokens, cfg.data_text, model->vocab(), cfg.seed).value();
  // The weights first: the trainer takes its f32 master copy (mixed precision) from the model.
  if (cfg.resume.empty() && !cfg.model_hf.empty())
    hf::load_weights(cfg.model_hf, mcfg, model->slots()).value();
  else if (cfg.resume.empty())
    model->init_weights(cfg.seed);
  models::trainer tr(*model, cfg);
  if (!cfg.resume.empty()) {
    auto step = tr.resume(cfg.resume, mcfg).value();
    models::check_steps_left(step, cfg, cfg.resume);
    fmt::print("resumed {} at step {}\n", cfg.resume, step);
  }
  auto& mem = model->memory();
  fmt::print(
      "troupe train: {} ({}), {:.2f} M parameters; B={} T={} grad_accum={}\n",
      models::model_label(cfg),
      models::with_family(mcfg, [](auto f, const auto&) { return decltype(f)::type::label; }),
      static_cast<double>(model->slots().param_count()) / 1e6, cfg.batch, cfg.seq, cfg.grad_accum);
  fmt::print("data: {}; {}\n", data.description,
             gpu ? std::string("on the GPU (cuda:0)")
                 : fmt::format("{} threads", parallel::num_threads()));
  fmt::print(
      "memory planned before step 1: params {:.1f} MB, grads {:.1f} MB, activations {:.1f} "
      "MB{}, scratch {:.1f} MB\n",
      mem.param_bytes() / 1e6, mem.param_bytes() / 1e6, mem.activation_bytes() / 1e6,
      cfg.recompute ? " (recompute)" : "", mem.scratch_bytes() / 1e6);

  auto json = open_json(c.json_path);
  progress bar(tr.steps_done(), cfg.steps, cfg.log_every, json.get());
  models::train_hooks hooks;
  hooks.on_step = [&bar](const models::step_result& r) { bar.report(r); };
  hooks.on_save = print_saved;
  const auto run = models::run_train_loop(cfg, tr.steps_done(),
                                          models::trainer_policy(tr, mcfg, data.rows), hooks);
  fmt::print("{}; host memory peak {:.1f} MB{}\n", models::trained_line(run),
             memory::stats(memory::tier::host).peak / 1e6,
             gpu ? fmt::format(", device memory peak {:.1f} MB",
                               memory::stats(memory::tier::device).peak / 1e6)
                 : std::string());
  if (!cfg.ckpt_dir.empty())
    fmt::print("checkpoint: {} (HF layout + optimizer state)\n", cfg.ckpt_dir);
  if (const std::string load = model->load_line(); !load.empty())
    fmt::print("MoE load of the last micro-batch, all layers: {}\n", load);

  if (c.sample.tokens > 0)
    fmt::print("sample ({}):\n{}\n", sample_settings, sample_text(*model, c.sample));
  return 0;
}

}  // namespace

command_fn add_train_command(CLI::App& app) {
  auto c = std::make_shared<train_cli>();
  auto* sub = app.add_subcommand(
      "train", "Train a GPT-2 or Llama model (one process, or one rank of troupe launch)");
  sub->add_option("--config", c->config_file, "TOML job file (flags override it)")
      ->check(CLI::ExistingFile);
  sub->add_flag("--demo", c->demo,
                "The demo: a 4-layer GPT on the fortunes corpus, bytes as tokens (the defaults)");
  bind<&train_config::model_size>(*c, sub, "--model",
                                  "Named size built from scratch "
                                  "(gpt2-demo, gpt2-small, bench-small, llama-tiny, mixtral-tiny)");
  bind<&train_config::model_hf>(*c, sub, "--model-hf", "HF model folder to start from");
  bind<&train_config::moe_capacity_factor>(
      *c, sub, "--moe-capacity-factor",
      "MoE models: each expert's capacity factor (0: dropless; over capacity: dropped)");
  bind<&train_config::moe_aux_loss_coef>(
      *c, sub, "--moe-aux-loss-coef",
      "MoE models: the router's aux loss coefficient (< 0: the model's; 0: no aux loss)");
  bind<&train_config::data_tokens>(*c, sub, "--tokens", "Token file (troupe tokenize)");
  bind<&train_config::data_text>(*c, sub, "--text", "Text file or folder, bytes as tokens");
  bind<&train_config::steps>(*c, sub, "--steps", "Optimizer steps");
  bind<&train_config::batch>(*c, sub, "--batch,-B", "Sequences per micro-batch");
  bind<&train_config::seq>(*c, sub, "--seq,-T", "Sequence length");
  bind<&train_config::grad_accum>(*c, sub, "--grad-accum", "Micro-batches per step");
  bind<&train_config::seed>(*c, sub, "--seed", "Seed of the weights and the batch order");
  bind<&train_config::fixed_batch>(*c, sub, "--fixed-batch", "Train on one batch again and again");
  bind<&train_config::precision>(
      *c, sub, "--precision",
      "f32, bf16 (f32 master weights; under any plan), f16 (+ dynamic loss scaling; under any "
      "plan) or f64 (the reference that f32 runs are judged against; one process, slow)");
  bind<&train_config::loss_scale>(*c, sub, "--loss-scale", "f16: the initial loss scale");
  bind<&train_config::loss_scale_growth>(
      *c, sub, "--loss-scale-growth",
      "f16: good steps in a row after which the loss scale doubles");
  bind<&train_config::compute_device>(
      *c, sub, "--device",
      "auto (the default: the GPU when one is visible and the run is one process without tiers "
      "or elastic), cpu or cuda");
  bind<&train_config::recompute>(*c, sub, "--recompute",
                                 "Activation checkpointing: keep only each block's input and run "
                                 "its forward again in backward");
  bind<&train_config::log_every>(*c, sub, "--log-every", "Steps between log lines");
  bind<&train_config::lr>(*c, sub, "--lr", "Peak learning rate");
  bind<&train_config::min_lr>(*c, sub, "--min-lr", "Learning rate at the end of the cosine");
  bind<&train_config::warmup>(*c, sub, "--warmup", "Warmup steps");
  bind<&train_config::beta1>(*c, sub, "--beta1", "AdamW beta1");
  bind<&train_config::beta2>(*c, sub, "--beta2", "AdamW beta2");
  bind<&train_config::eps>(*c, sub, "--eps", "AdamW eps");
  bind<&train_config::weight_decay>(*c, sub, "--weight-decay", "AdamW weight decay");
  bind<&train_config::decay_exempt>(*c, sub, "--decay-exempt",
                                    "No weight decay on biases, norm weights and embeddings");
  bind<&train_config::clip>(*c, sub, "--clip", "Gradient-norm clip (0: off)");
  bind<&train_config::ckpt_dir>(*c, sub, "--checkpoint-dir", "Folder to save checkpoints to");
  bind<&train_config::ckpt_every>(*c, sub, "--checkpoint-every", "Steps between checkpoints");
  bind<&train_config::resume>(*c, sub, "--resume", "Checkpoint folder to resume from");
  bind<&train_config::collective_timeout>(
      *c, sub, "--collective-timeout",
      "Seconds a collective or transfer of a launched run may take before it fails naming the "
      "ranks it waits for (0: no deadline)");
  bind<&train_config::elastic_enabled>(
      *c, sub, "--elastic",
      "A launched run survives the loss of a rank: each step commits at its optimizer step; "
      "with spares a spare takes the lost rank's place, else the run ends naming the last "
      "committed step");
  bind<&train_config::elastic_spares>(
      *c, sub, "--spares",
      "Ranks started beyond the plan's that take lost ranks' places (troupe launch --spares S "
      "gives its S)");
  bind<&train_config::elastic_replica_interval>(
      *c, sub, "--replica-interval",
      "Elastic: every K steps each rank copies its piece state to its buddy rank, so pieces "
      "without a data-parallel replica can be restored (0: none)");
  bind<&train_config::elastic_min_ranks>(
      *c, sub, "--min-ranks",
      "Elastic: with no spare left, shrink onto the survivors (fewer data-parallel replicas, the "
      "global batch kept) down to this many ranks (0: the full plan, no shrinking; troupe launch "
      "--min-ranks M gives its M)");
  bind<&train_config::elastic_join_wait>(
      *c, sub, "--join-wait",
      "Elastic: a rank lost with no spare left waits up to this many seconds for a joiner "
      "(troupe launch --join) to take its place before shrinking or ending (0: no wait)");
  bind<&train_config::elastic_await_join>(
      *c, sub, "--await-join",
      "Drill: before step STEP the driver waits until a joiner arrived (up to --join-wait "
      "seconds, 120 when 0)");
  bind<&train_config::elastic_chaos_kill>(
      *c, sub, "--chaos-kill",
      "Drill: RANK:STEP:PHASE[,...] - that rank's process SIGKILLs itself as step STEP reaches "
      "PHASE (forward, backward, commit, optimizer or replicate: during the buddy copy after "
      "step STEP); several entries separated by commas");
  auto plan_flag = [&](CLI::Option* opt, std::function<void(train_config&)> apply) {
    c->plan_flags.emplace_back(opt, std::move(apply));
  };
  add_plan_flags(sub, c->plan, c->plan_flags);
  bind<&train_config::pipe_trace>(
      *c, sub, "--pipe-trace",
      "Path prefix: pipeline stages append each step's actions and times to "
      "PREFIX.stage<s>.<pid>.txt (scripts/bench/pipe_trace.py reads them)");
  // [memory] flags: sizes take suffixes (64M, 2G), so they are parsed here.
  auto size_flag = [&](const std::string& name, std::uint64_t train_config::*field,
                       const std::string& help) {
    auto text = std::make_shared<std::string>();
    plan_flag(sub->add_option(name, *text, help), [text, field, name](train_config& t) {
      auto v = models::parse_byte_size(*text);
      TROUPE_CHECK(v.has_value(), name, " must be a size like 64M or 2G, got '", *text, "'");
      t.*field = *v;
    });
  };
  size_flag("--device-memory", &train_config::mem_device,
            "Train with memory tiers under this device budget (e.g. 64M; non-model memory "
            "included)");
  size_flag("--host-memory", &train_config::mem_host,
            "Host budget for chunks with --device-memory (e.g. 2G; default unlimited)");
  size_flag("--nvme-capacity", &train_config::mem_nvme_capacity,
            "Limit on the NVMe tier's file (default: the disk's size)");
  bind<&train_config::mem_nvme_dir>(*c, sub, "--nvme-dir",
                                    "Directory of the NVMe tier (offloaded chunks go there)");
  bind<&train_config::mem_offload>(*c, sub, "--offload",
                                   "Placement with --device-memory: auto (measure the first step, "
                                   "keep what fits resident) or fixed (the fractions)");
  bind<&train_config::mem_offload_params>(*c, sub, "--offload-params",
                                          "Fraction of parameter chunks offloaded (fixed)");
  bind<&train_config::mem_offload_optimizer>(
      *c, sub, "--offload-optimizer", "Fraction of optimizer-state chunks offloaded (fixed)");
  sub->add_option("--json", c->json_path,
                  "Write per-step loss and grad norm as JSON lines "
                  "to this file ('-': standard output)");
  sub->add_option("--threads", c->threads, "CPU threads (0: all)");
  sub->add_option("--sample", c->sample.tokens, "Tokens to generate at the end (0: none)")
      ->capture_default_str();
  sub->add_option("--prompt", c->sample.prompt, "Prompt of the generated text")
      ->capture_default_str();
  sub->add_option("--tokenizer", c->sample.tokenizer,
                  "Tokenizer to encode the prompt and decode the "
                  "sample (byte, gpt2:DIR, spm:FILE)")
      ->capture_default_str();
  return [sub, c]() -> int {
    if (!sub->parsed()) return -1;
    return run_train(*c);
  };
}

}  // namespace troupe::apps
