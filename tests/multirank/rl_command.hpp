// rl_command: what the RL command tests share (tests/multirank/grpo_command.test.cpp,
// ppo_command.test.cpp): running the troupe binary, reading its --json lines, and the warm start
// the RL examples make (apps/examples/addition_task.hpp).
#pragma once

#include <fmt/core.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdint>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/hf/config.hpp"
#include "models/trainer.hpp"
#include "tests/multirank/train_runs.hpp"

namespace troupe::tests {

struct run_result {
  int code = -1;
  std::string output;
};

inline run_result run_troupe(std::vector<std::string> args) {
  args.insert(args.begin(), troupe_bin);
  child_process p(args, {{"TROUPE_NUM_THREADS", "1"}});
  auto st = p.wait(std::chrono::seconds(300));
  INFO(p.output());
  REQUIRE(st.has_value());
  return {child_process::code(*st), p.output()};
}

inline std::vector<nlohmann::json> json_lines(const std::string& path) {
  std::ifstream in(path);
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// The example's warm start (apps/examples/grpo.cpp): a Llama of 2 x 64 over bytes trained from
// scratch on "a+b=" rows whose answer ("sum\n") is replaced by a random number in half of them, so
// that it knows the format and samples the right sum about half of the time. Saved in HF layout.
inline void addition_sft(const std::string& folder) {
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
  const models::hf::model_config cfg(c);
  const std::int64_t batch = 64, seq = 7, prompt_len = 4;
  auto m = models::make_causal_lm(cfg, {batch, seq});
  m->init_weights(1);
  models::train_config tc;
  tc.lr = 3e-3;
  tc.min_lr = 3e-4;
  tc.warmup = 20;
  tc.steps = 600;
  tc.weight_decay = 0.0;
  tc.batch = batch;
  tc.seq = seq;
  models::trainer t(*m, tc);
  std::vector<std::int32_t> ids, targets;
  std::mt19937_64 g(1);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::uniform_int_distribution<int> digit(0, 9), wrong(0, 18);
  const auto step = [&](models::causal_lm& model, std::uint64_t, double loss_scale) {
    ids.assign(static_cast<std::size_t>(batch * seq), '\n');
    targets.assign(ids.size(), -100);
    for (std::int64_t r = 0; r < batch; ++r) {
      const int a = digit(g), b = digit(g);
      const int answer = coin(g) < 0.5 ? wrong(g) : a + b;
      const std::string text = fmt::format("{}+{}={}\n", a, b, answer);
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
  for (std::int64_t s = 0; s < tc.steps; ++s) t.step(step);
  REQUIRE(t.save(folder, cfg).has_value());
}

}  // namespace troupe::tests
