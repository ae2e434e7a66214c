// post_run: what troupe sft and troupe dpo share (apps/cmd_sft.cpp, apps/cmd_dpo.cpp): their
// common flags, the tokenizer with the chat template's special tokens, the model (a named size
// sized to the tokenizer and the special tokens, or an HF folder), and the progress lines.
//
// Special tokens: the templates' tokens (<|im_start|>, ...) get the ids after the tokenizer's
// vocabulary, as HF's add_special_tokens numbers them; the model's vocabulary must hold them (a
// named size is built so; an HF folder whose vocabulary is too small is refused naming it).
// troupe sft and troupe dpo also take troupe train's plan flags and, under troupe launch, train
// through the launched driver (apps/post_launched.hpp); troupe rm runs in one process and refuses
// launch.
//
// Job files: --config takes the TOML of troupe train (models/train_config.hpp: [model], [train],
// [optim], [checkpoint]); the flags given override it. The data, template, tokenizer and the
// losses' settings are flags. For troupe dpo, train.batch counts pairs (rows are twice that).
#pragma once

#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "actors/bootstrap.hpp"
#include "apps/plan_flags.hpp"
#include "models/causal_lm.hpp"
#include "models/families.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/post/chat_template.hpp"
#include "models/text/tokenizer.hpp"
#include "models/train_config.hpp"
#include "models/train_loop.hpp"
#include "models/trainer.hpp"
#include "tensor/parallel.hpp"

namespace troupe::apps {

struct post_cli {
  std::string data, chat_template = "chatml", model = "llama-tiny", model_hf;
  std::string tokenizer = "byte", ckpt_dir, json_path, precision = "f32";
  std::int64_t steps = 40, batch = 4, seq = 128, grad_accum = 1, log_every = 10, warmup = 5;
  std::int64_t ckpt_every = 0;
  double lr = 1e-3, min_lr = 1e-4, weight_decay = 0.0, clip = 1.0;
  std::uint64_t seed = 1337;
  bool truncate = false;
  int threads = 0;
  std::string config_file;
  // The training flags given on the command line, applied over --config's file.
  std::vector<std::pair<CLI::Option*, std::function<void(models::train_config&)>>> overrides;
};

inline void add_post_flags(CLI::App* sub, post_cli& c, const std::string& batch_help) {
  using models::train_config;
  sub->add_option("--config", c.config_file, "TOML job file of troupe train (flags override it)")
      ->check(CLI::ExistingFile);
  sub->add_option("--data", c.data, "JSONL file")->required()->check(CLI::ExistingFile);
  sub->add_option("--template", c.chat_template, "Chat template: llama3 or chatml")
      ->capture_default_str();
  sub->add_option("--tokenizer", c.tokenizer, "byte, gpt2:DIR or spm:FILE")->capture_default_str();
  sub->add_flag("--truncate", c.truncate,
                "Keep the first --seq tokens of a longer example instead of refusing it");
  sub->add_option("--json", c.json_path, "Per-step JSON lines to this file ('-': stdout)");
  sub->add_option("--threads", c.threads, "CPU threads (0: all)");
  auto knob = [&](CLI::Option* o, std::function<void(train_config&)> apply) {
    o->capture_default_str();
    c.overrides.emplace_back(o, std::move(apply));
  };
  post_cli* p = &c;
  knob(sub->add_option("--model", c.model, "Named size built from scratch (llama-tiny, ...)"),
       [p](train_config& t) { t.model_size = p->model; });
  knob(sub->add_option("--model-hf", c.model_hf, "HF model folder to start from"),
       [p](train_config& t) { t.model_hf = p->model_hf; });
  knob(sub->add_option("--steps", c.steps, "Optimizer steps"),
       [p](train_config& t) { t.steps = p->steps; });
  knob(sub->add_option("--batch,-B", c.batch, batch_help),
       [p](train_config& t) { t.batch = p->batch; });
  knob(sub->add_option("--seq,-T", c.seq, "Tokens per row"),
       [p](train_config& t) { t.seq = p->seq; });
  knob(sub->add_option("--grad-accum", c.grad_accum, "Micro-batches per step"),
       [p](train_config& t) { t.grad_accum = p->grad_accum; });
  knob(sub->add_option("--lr", c.lr, "Peak learning rate"), [p](train_config& t) { t.lr = p->lr; });
  knob(sub->add_option("--min-lr", c.min_lr, "Learning rate at the end of the cosine"),
       [p](train_config& t) { t.min_lr = p->min_lr; });
  knob(sub->add_option("--warmup", c.warmup, "Warmup steps"),
       [p](train_config& t) { t.warmup = p->warmup; });
  knob(sub->add_option("--weight-decay", c.weight_decay, "AdamW weight decay"),
       [p](train_config& t) { t.weight_decay = p->weight_decay; });
  knob(sub->add_option("--clip", c.clip, "Gradient-norm clip (0: off)"),
       [p](train_config& t) { t.clip = p->clip; });
  knob(sub->add_option("--seed", c.seed, "Seed of the weights"),
       [p](train_config& t) { t.seed = p->seed; });
  knob(sub->add_option("--checkpoint-dir", c.ckpt_dir, "Folder to save the HF checkpoint to"),
       [p](train_config& t) { t.ckpt_dir = p->ckpt_dir; });
  knob(sub->add_option("--checkpoint-every", c.ckpt_every, "Steps between checkpoints (0: end)"),
       [p](train_config& t) { t.ckpt_every = p->ckpt_every; });
  knob(sub->add_option("--log-every", c.log_every, "Steps between log lines"),
       [p](train_config& t) { t.log_every = p->log_every; });
  knob(sub->add_option("--precision", c.precision,
                       "f32; bf16 or f16 (troupe sft, dpo: f32 master weights); or f64 (the "
                       "reference the others are judged against; one process)"),
       [p](train_config& t) { t.precision = p->precision; });
}

struct post_setup {
  std::int64_t per_batch = 0;  // train.batch: rows (sft) or pairs (dpo) per micro-batch
  std::string label;           // the model, for the log
  std::unique_ptr<models::tokenizer> tok;
  models::chat_format format{};
  models::chat_specials specials;
  models::train_config cfg;
  models::hf::model_config mcfg;
};

// rows_per_unit: rows of one unit of train.batch (1: a row, 2: a pair). plan: the command's
// plan flags (apps/plan_flags.hpp), applied over the job file's [parallel]; a command without
// them (null) runs in one process only and refuses troupe launch.
inline post_setup prepare_post(const post_cli& c, const char* command, std::int64_t rows_per_unit,
                               const config_flags* plan = nullptr) {
  TROUPE_CHECK(plan != nullptr || !actors::join_info_from_env().has_value(), "troupe ", command,
               " runs in one process; it does not run under troupe launch yet");
  if (c.threads > 0) parallel::set_num_threads(c.threads);
  post_setup s;
  s.tok = models::load_tokenizer(c.tokenizer).value();
  auto f = models::parse_chat_format(c.chat_template);
  if (!f) throw error("--template: " + f.error_message());
  s.format = *f;
  s.specials = models::chat_specials::appended(s.format, s.tok->vocab_size());
  models::train_config& cfg = s.cfg;
  if (c.config_file.empty()) {  // the flags and their defaults
    for (const auto& [opt, apply] : c.overrides) apply(cfg);
  } else {  // the file, then the flags given
    cfg = models::load_train_config(c.config_file).value();
    for (const auto& [opt, apply] : c.overrides)
      if (opt->count() > 0) apply(cfg);
  }
  if (plan != nullptr) apply_given(*plan, cfg);
  s.per_batch = cfg.batch;
  cfg.batch *= rows_per_unit;
  s.label = cfg.model_hf.empty() ? cfg.model_size : cfg.model_hf;
  cfg.validate();
  const std::int64_t need = s.specials.end();
  s.mcfg = cfg.model_hf.empty() ? models::named_model_config(cfg.model_size, need).value()
                                : models::hf::read_config(cfg.model_hf).value();
  const std::int64_t vocab =
      models::with_family(s.mcfg, [](auto, const auto& mc) { return mc.vocab; });
  TROUPE_CHECK(vocab >= need, "model.hf (--model-hf) ", cfg.model_hf, ": its vocabulary (", vocab,
               ") has no room for the ", c.chat_template, " template's special tokens (ids ",
               s.tok->vocab_size(), "..", need - 1, " after the tokenizer's)");
  return s;
}

// The run's compute precision (train.precision: f32, bf16 or f16 with f32 master weights in the
// trainer, or f64 for the reference twin).
inline dtype post_dtype(const post_setup& s) {
  const auto& p = s.cfg.precision;
  return p == "f64" ? dtype::f64 : p == "bf16" ? dtype::bf16 : p == "f16" ? dtype::f16 : dtype::f32;
}

// The model of the run: the HF folder's weights, or initialised from the seed.
inline std::unique_ptr<models::causal_lm> make_post_model(const post_setup& s) {
  TROUPE_CHECK(s.cfg.precision == "f32" || s.cfg.precision == "f64" || s.cfg.precision == "bf16" ||
                   s.cfg.precision == "f16",
               "train.precision (--precision) ", s.cfg.precision,
               ": post-training runs in f32, bf16 or f16, or f64 (the reference)");
  auto m = models::make_causal_lm(s.mcfg, {s.cfg.batch, s.cfg.seq}, post_dtype(s));
  TROUPE_CHECK(s.cfg.seq <= m->max_seq(), "--seq ", s.cfg.seq, " exceeds the model's ",
               m->max_seq(), " positions");
  if (s.cfg.model_hf.empty())
    m->init_weights(s.cfg.seed);
  else
    models::hf::load_weights(s.cfg.model_hf, s.mcfg, m->slots()).value();
  return m;
}

// --json: per-step lines to a file, or to standard output for "-"; null when not asked.
inline std::unique_ptr<std::FILE, int (*)(std::FILE*)> open_post_json(const std::string& path) {
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> json(nullptr, std::fclose);
  if (path.empty()) return json;
  json.reset(path == "-" ? fdopen(dup(STDOUT_FILENO), "w") : std::fopen(path.c_str(), "w"));
  TROUPE_CHECK(json != nullptr, "--json: cannot write ", path);
  return json;
}

// Runs the one training loop (models/train_loop.hpp) with the command's policy and hooks, prints
// each save, the closing line and where the checkpoint went (`layout`: what kind of folder it is).
inline int run_post_loop(const post_setup& s, const models::train_policy& policy,
                         models::train_hooks hooks, const std::string& layout) {
  hooks.on_save = [](std::int64_t step, const std::string& dir, std::optional<std::int64_t> held) {
    fmt::print("{}\n", models::hf::saved_line(dir, step, held));
  };
  const auto run = models::run_train_loop(s.cfg, 0, policy, hooks);
  fmt::print("{}\n", models::trained_line(run));
  if (!s.cfg.ckpt_dir.empty()) fmt::print("checkpoint: {} ({})\n", s.cfg.ckpt_dir, layout);
  return 0;
}

}  // namespace troupe::apps
