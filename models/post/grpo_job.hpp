// grpo_job: everything `troupe grpo` is told (apps/cmd_grpo.cpp), from a TOML job file and/or
// command-line flags (flags win). Validated before anything starts; errors name the file and the
// key as "section.key", with its flag.
//
//   [model]       hf = "DIR" (an HF folder, e.g. troupe sft's checkpoint) or size = "llama-tiny"
//   [grpo]        task = "addition" (generated a+b= prompts: digits = 1 or 2) or "prompts"
//                 (prompts_file: JSONL of {"prompt", "answer"}); reward = "exact" or "partial";
//                 template = "" (raw text), "chatml" or "llama3"; tokenizer = "byte", "gpt2:DIR"
//                 or "spm:FILE"; steps, prompts_per_step, group (samples per prompt: the group
//                 GRPO normalises over), max_new_tokens, temperature, top_p, kl_coef (TRL's
//                 beta; 0: no reference actor), clip_epsilon (TRL's epsilon), seed, rollouts
//                 (rollout actors), staleness (0: sync; 1: async), log_every
//   [optim]       lr, warmup, weight_decay, clip, beta1, beta2
//   [checkpoint]  dir, every
//
// Keys of troupe train's job files that GRPO does not read (train.batch, data.*, parallel.*) are
// refused by name, as unknown keys are: a GRPO step's rows are prompts_per_step x group.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "memory/error.hpp"

namespace troupe::models {

struct grpo_job {
  // [model]
  std::string model_hf;                   // an HF folder (config.json + safetensors)
  std::string model_size = "llama-tiny";  // a named size built from scratch (seeded)
  // [grpo]
  std::string task = "addition";  // "addition" or "prompts"
  std::int64_t digits = 1;        // addition: digits of the operands (1: 0-9; 2: 10-99)
  std::string prompts_file;       // prompts: JSONL, one {"prompt", "answer"} per line
  std::string reward = "exact";   // "exact" (1 or 0) or "partial" (share of characters in place)
  std::string chat_template;      // "" (prompts as raw text), "chatml" or "llama3"
  std::string tokenizer = "byte";
  std::int64_t steps = 20, prompts_per_step = 16, group = 8, max_new_tokens = 8;
  double temperature = 1.0, top_p = 1.0;
  double kl_coef = 0.04, clip_epsilon = 0.2;
  std::uint64_t seed = 1;
  std::int64_t rollouts = 1, staleness = 0, log_every = 1;
  // [optim]: a constant rate after a linear warmup
  double lr = 1e-4, weight_decay = 0.0, clip = 1.0, beta1 = 0.9, beta2 = 0.99;
  std::int64_t warmup = 0;
  // [checkpoint]
  std::string ckpt_dir;
  std::int64_t ckpt_every = 0;  // 0: only at the end (when dir is set)
  // [parallel]: the trainer's plan under troupe launch (troupe train's keys; the flags --dp, --tp,
  // --pp, --zero, --microbatches, --sp override them): dp x tp x pp trainer ranks
  std::int64_t dp = 1, tp = 1, pp = 1, zero = 0, microbatches = 1;
  bool sp = false;

  // Checks ranges and combinations; the message names "section.key (--flag)".
  void validate() const;
  friend bool operator==(const grpo_job&, const grpo_job&) = default;
};

// Reads a TOML job file over the defaults; unknown sections or keys, wrong types and bad values
// are errors naming the file and "section.key". A file over 1 MiB is refused unread.
expected<grpo_job> load_grpo_job(const std::string& path);
// The same from TOML text; errors name `origin` as they would name the file.
expected<grpo_job> parse_grpo_job(std::string_view text, const std::string& origin);

}  // namespace troupe::models
