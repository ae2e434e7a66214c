// An actor script for GRPO on a verifiable task: a tiny Llama (2 x 64, byte tokens) learns to add
// two 2-digit numbers ("12+34=" -> "46\n"). First a short SFT from scratch in this process gives
// it the format and some of the arithmetic; then GRPO (actors/grpo_loop.hpp) trains it with a C++
// verifier as the reward (1 when the completion is exactly the sum and a newline, else 0), with
// rollout, reward, reference and trainer actors. It prints the mean reward of every iteration.
//
//   build/apps/troupe launch -n 1 -- build/apps/examples/troupe_example_grpo
//   ... --iterations 30 --rollouts 2 --async --beta 0
//
// Every actor sits on rank 0 here (the roles' messages are plain structs and the weights travel as
// tensor messages, so other placements need only other ranks in grpo_loop_options).
#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "actors/grpo_loop.hpp"
#include "actors/grpo_roles.hpp"
#include "actors/node.hpp"
#include "models/causal_lm.hpp"
#include "models/trainer.hpp"

using namespace troupe;

namespace {

constexpr std::int64_t prompt_len = 6;  // "ab+cd="
constexpr std::int64_t max_new = 4;     // up to 3 digits and the newline
constexpr std::int32_t eos = '\n';

struct problem {
  int a = 0, b = 0;
  std::string prompt() const { return fmt::format("{}+{}=", a, b); }
  std::string answer() const { return fmt::format("{}\n", a + b); }
};

problem draw(std::mt19937_64& g) {
  std::uniform_int_distribution<int> d(10, 99);
  const int a = d(g);
  return {a, d(g)};
}

// The verifier: the reward actor's C++ function.
double verify(std::span<const std::int32_t> prompt, std::span<const std::int32_t> completion) {
  std::string p(prompt.begin(), prompt.end()), c(completion.begin(), completion.end());
  int a = 0, b = 0;
  if (std::sscanf(p.c_str(), "%d+%d=", &a, &b) != 2) return 0.0;
  return c == fmt::format("{}\n", a + b) ? 1.0 : 0.0;
}

models::hf::model_config tiny_llama() {
  models::hf::llama_config c;
  c.vocab_size = 256;
  c.hidden_size = 64;
  c.intermediate_size = 176;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 16;
  c.rms_norm_eps = 1e-5;
  return models::hf::model_config(c);
}

// SFT from scratch: rows "ab+cd=" + answer, trained on the answer tokens; saved in HF layout.
std::filesystem::path sft(const std::filesystem::path& folder, std::int64_t steps,
                          std::uint64_t seed, double lr) {
  const auto cfg = tiny_llama();
  const std::int64_t batch = 64, seq = prompt_len + max_new;
  auto m = models::make_causal_lm(cfg, {batch, seq});
  m->init_weights(seed);
  models::train_config tc;
  tc.lr = lr;
  tc.min_lr = lr / 10;
  tc.warmup = 20;
  tc.steps = steps;
  tc.weight_decay = 0.0;
  tc.batch = batch;
  tc.seq = seq;
  tc.seed = seed;
  models::trainer t(*m, tc);
  std::vector<std::int32_t> ids, targets;
  std::mt19937_64 g(seed);
  const auto step = [&](models::causal_lm& model, std::uint64_t, double loss_scale) {
    ids.assign(static_cast<std::size_t>(batch * seq), eos);
    targets.assign(ids.size(), -100);
    for (std::int64_t r = 0; r < batch; ++r) {
      const problem p = draw(g);
      const std::string text = p.prompt() + p.answer();
      for (std::size_t i = 0; i < text.size(); ++i) {
        ids[static_cast<std::size_t>(r * seq) + i] = static_cast<unsigned char>(text[i]);
        if (i >= static_cast<std::size_t>(prompt_len))
          targets[static_cast<std::size_t>(r * seq) + i - 1] = static_cast<unsigned char>(text[i]);
      }
    }
    const double loss =
        model.forward(tensor(ids.data(), ids.size() * 4, dtype::i32, {batch, seq}),
                      tensor(targets.data(), targets.size() * 4, dtype::i32, {batch, seq}));
    model.backward(loss_scale);
    return loss;
  };
  double first = 0, last = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    last = t.step(step).loss;
    if (s == 0) first = last;
  }
  fmt::print("sft: {} steps, answer loss {:.3f} -> {:.3f}\n", steps, first, last);
  auto saved = t.save(folder, cfg);
  TROUPE_CHECK(saved.has_value(), "sft: ", saved.error_message());
  return *saved;
}

}  // namespace

int main(int argc, char** argv) {
  actors::grpo_loop_options o;
  o.iterations = 30;
  o.prompts = 16;
  o.prompt_len = prompt_len;
  o.group = 8;
  o.max_new = max_new;
  o.eos = eos;
  o.trainer.lr = 1e-3;
  o.trainer.beta = 0.04;
  o.trainer.warmup = 0;
  std::int64_t sft_steps = 300;
  double sft_lr = 3e-3;
  int rollouts = 1;
  bool async = false;
  std::string dir = fmt::format("/tmp/troupe-grpo-example-{}", ::getpid());

  CLI::App app("GRPO on 2-digit addition with a C++ verifier (under troupe launch -n 1)");
  app.add_option("--iterations", o.iterations, "GRPO iterations")->capture_default_str();
  app.add_option("--sft-steps", sft_steps, "SFT steps from scratch first")->capture_default_str();
  app.add_option("--sft-lr", sft_lr, "SFT learning rate")->capture_default_str();
  app.add_option("--prompts", o.prompts, "Prompts per iteration")->capture_default_str();
  app.add_option("--group", o.group, "Completions per prompt")->capture_default_str();
  app.add_option("--lr", o.trainer.lr, "GRPO learning rate")->capture_default_str();
  app.add_option("--beta", o.trainer.beta, "KL coefficient (0: no reference actor)")
      ->capture_default_str();
  app.add_option("--epsilon", o.trainer.epsilon, "Ratio clip range")->capture_default_str();
  app.add_option("--temperature", o.temperature, "Sampling temperature")->capture_default_str();
  app.add_option("--top-p", o.top_p, "Nucleus sampling")->capture_default_str();
  app.add_option("--rollouts", rollouts, "Rollout actors")->capture_default_str();
  app.add_flag("--async", async, "Sample the next batch while training (staleness 1)");
  app.add_option("--seed", o.seed, "Seed of the model, the data and the sampling")
      ->capture_default_str();
  app.add_option("--dir", dir, "Where the SFT checkpoint is written")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  o.staleness = async ? 1 : 0;
  o.rollout_ranks.assign(static_cast<std::size_t>(rollouts), 0);

  try {
    actors::role_registry roles;
    actors::add_grpo_roles(roles, verify);
    actors::node_options no;
    no.roles = &roles;
    actors::node n(no);
    if (n.rank() == 0) {
      o.checkpoint = sft(std::filesystem::path(dir) / "sft", sft_steps, o.seed, sft_lr).string();
      std::mt19937_64 g(o.seed + 1);
      auto prompts = [&](std::int64_t) {
        std::vector<std::int32_t> out;
        for (std::int64_t i = 0; i < o.prompts; ++i)
          for (char ch : draw(g).prompt()) out.push_back(static_cast<unsigned char>(ch));
        return out;
      };
      fmt::print("grpo: {} prompts x {} samples per iteration, {} rollout actor(s), {}\n",
                 o.prompts, o.group, rollouts, async ? "async (staleness 1)" : "sync");
      double gen = 0, train = 0, total = 0;
      std::int64_t tokens = 0;
      actors::run_grpo(n, o, prompts, [&](const actors::grpo_iteration& it) {
        fmt::print(
            "iteration {:3d}  mean reward {:.3f}  loss {:+.4f}  kl {:.4f}  clipped {:.3f}  "
            "weights v{}  generate {:.2f} s  train {:.2f} s  sync {:.3f} s\n",
            it.iteration, it.mean_reward, it.train.loss, it.train.kl, it.train.clip_ratio,
            it.sampled_by, it.generate_seconds + it.logprob_seconds, it.train_seconds,
            it.sync_seconds);
        std::fflush(stdout);
        gen += it.generate_seconds;
        train += it.train_seconds;
        total += it.seconds;
        tokens += it.new_tokens;
      });
      fmt::print("rollout {:.0f} tokens/s; of {:.1f} s: generating {:.0f}%, training {:.0f}%\n",
                 static_cast<double>(tokens) / gen, total, 100 * gen / total, 100 * train / total);
      std::filesystem::remove_all(dir);
    }
    n.barrier("grpo: done");
    n.shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_example_grpo: %s\n", e.what());
    return 1;
  }
  return 0;
}
