// troupe generate: sample text from a checkpoint with the kv cache.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <memory>

#include "apps/commands.hpp"
#include "models/causal_lm.hpp"
#include "models/generation.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/text/tokenizer.hpp"

namespace troupe::apps {
namespace {

struct generate_args {
  std::string model, tokenizer = "byte", prompt = "The ";
  std::int64_t max_new = 200;
  models::sampling_options sampling{.temperature = 0.8};
  std::uint64_t seed = 1;
};

int run_generate(const generate_args& a) {
  auto cfg = models::hf::read_config(a.model).value();
  auto tok = models::load_tokenizer(a.tokenizer).value();
  auto prompt = tok->encode(a.prompt);
  // Planned for the prompt (the first step); the kv cache grows to prompt + max_new positions.
  auto model = models::make_causal_lm(cfg, {1, std::max<std::int64_t>(1, std::ssize(prompt))});
  models::hf::load_weights(a.model, cfg, model->slots()).value();
  models::token_sampler sampler(a.sampling, a.seed);
  fmt::print("{}", a.prompt);
  std::fflush(stdout);
  models::generate(*model, prompt, a.max_new, sampler, tok->eos_id(), [&](std::int32_t id) {
    fmt::print("{}", tok->decode({&id, 1}));
    std::fflush(stdout);
  });
  fmt::print("\n");
  return 0;
}

}  // namespace

command_fn add_generate_command(CLI::App& app) {
  auto a = std::make_shared<generate_args>();
  auto* sub = app.add_subcommand("generate", "Sample text from a checkpoint (kv cache)");
  sub->add_option("--model", a->model, "HF model folder (config.json + safetensors)")->required();
  sub->add_option("--tokenizer", a->tokenizer, "byte, gpt2:DIR or spm:FILE")->capture_default_str();
  sub->add_option("--prompt", a->prompt, "Text to continue")->capture_default_str();
  sub->add_option("--max-new", a->max_new, "Tokens to generate")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_flag("--greedy", a->sampling.greedy, "Take the most likely token every time");
  sub->add_option("--temperature", a->sampling.temperature, "Softmax temperature")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--top-k", a->sampling.top_k, "Keep the k most likely tokens (0: all)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--top-p", a->sampling.top_p, "Keep the smallest set reaching this probability")
      ->capture_default_str()
      ->check(CLI::Range(1e-9, 1.0));
  sub->add_option("--seed", a->seed, "Sampling seed")->capture_default_str();
  return [sub, a]() -> int {
    if (!sub->parsed()) return -1;
    return run_generate(*a);
  };
}

}  // namespace troupe::apps
