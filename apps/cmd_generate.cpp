// troupe generate: sample text from a checkpoint with the kv cache. One sample streams its tokens
// as they are chosen; --num-samples N decodes N completions of the prompt together (one batch of N
// rows through the kv cache: the rollout actors' batched sampling, models/post/rollout.hpp) and
// prints each. --stats reports the new tokens and their rate.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>

#include "apps/commands.hpp"
#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/generation.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/post/rollout.hpp"
#include "models/text/tokenizer.hpp"

namespace troupe::apps {
namespace {

struct generate_args {
  std::string model, tokenizer = "byte", prompt = "The ";
  std::int64_t max_new = 200;
  std::int64_t num_samples = 1;
  std::int64_t repeat = 1;
  bool stats = false;
  models::sampling_options sampling{.temperature = 0.8};
  std::uint64_t seed = 1;
};

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

void print_stats(std::int64_t new_tokens, std::int64_t rows, double s) {
  fmt::print("generated {} new tokens in {} row{} in {:.3f} s: {:.0f} tokens/s\n", new_tokens, rows,
             rows == 1 ? "" : "s decoding together", s,
             s > 0 ? static_cast<double>(new_tokens) / s : 0.0);
}

// N completions of the prompt decoded as one batch; each printed on its own, after the prompt.
int run_batched(const generate_args& a, const models::hf::model_config& cfg,
                const models::tokenizer& tok, const std::vector<std::int32_t>& prompt) {
  const auto p = std::max<std::int64_t>(1, std::ssize(prompt));
  auto model = models::make_causal_lm(cfg, {a.num_samples, p});
  models::hf::load_weights(a.model, cfg, model->slots()).value();
  // At most the positions the model holds, as the one-sample path stops at max_seq.
  const std::int64_t max_new = std::min(a.max_new, model->max_seq() - p);
  TROUPE_CHECK(max_new > 0, "troupe generate: the prompt's ", p, " tokens fill the model's ",
               model->max_seq(), " positions (--prompt)");
  const models::rollout_options o{.group = a.num_samples,
                                  .max_new = max_new,
                                  .sampling = a.sampling,
                                  .eos = tok.eos_id(),
                                  .seed = a.seed};
  // --repeat K: the same batch K times (the same seed, so the same tokens); the rate is the
  // median run's, so a benchmark sees the warm kernels the rollout actors see after their first.
  models::rollout_rows rows;
  std::vector<double> times;
  for (std::int64_t k = 0; k < a.repeat; ++k) {
    const auto t0 = clock_type::now();
    rows = models::sample_completions(*model, prompt, p, o);
    times.push_back(seconds_since(t0));
  }
  std::ranges::sort(times);
  const double s = times[times.size() / 2];
  for (std::int64_t r = 0; r < rows.rows; ++r) {
    auto c = rows.completion(r);
    if (!c.empty() && c.back() == tok.eos_id()) c = c.first(c.size() - 1);
    fmt::print("[{}] {}{}\n", r, a.prompt, tok.decode(c));
  }
  if (a.stats) print_stats(rows.new_tokens(), rows.rows, s);
  return 0;
}

int run_generate(const generate_args& a) {
  auto cfg = models::hf::read_config(a.model).value();
  auto tok = models::load_tokenizer(a.tokenizer).value();
  auto prompt = tok->encode(a.prompt);
  TROUPE_CHECK(a.repeat == 1 || a.num_samples > 1,
               "troupe generate: --repeat is for batched sampling (--num-samples > 1)");
  if (a.num_samples > 1) return run_batched(a, cfg, *tok, prompt);
  // Planned for the prompt (the first step); the kv cache grows to prompt + max_new positions.
  auto model = models::make_causal_lm(cfg, {1, std::max<std::int64_t>(1, std::ssize(prompt))});
  models::hf::load_weights(a.model, cfg, model->slots()).value();
  models::token_sampler sampler(a.sampling, a.seed);
  fmt::print("{}", a.prompt);
  std::fflush(stdout);
  const auto t0 = clock_type::now();
  const auto ids =
      models::generate(*model, prompt, a.max_new, sampler, tok->eos_id(), [&](std::int32_t id) {
        fmt::print("{}", tok->decode({&id, 1}));
        std::fflush(stdout);
      });
  const double s = seconds_since(t0);  // streaming the tokens included
  fmt::print("\n");
  if (a.stats) print_stats(std::ssize(ids), 1, s);
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
  sub->add_option("--num-samples", a->num_samples,
                  "Completions of the prompt, decoded together as one batch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_flag("--stats", a->stats, "Print the new tokens and tokens/s at the end");
  sub->add_option("--repeat", a->repeat,
                  "Batched: sample the batch this many times and report the median run's rate")
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
