// addition_task: the verifiable task of the RL examples (grpo.cpp, ppo.cpp): a tiny Llama (2 x 64,
// byte tokens) adds two numbers ("3+5=" -> "8\n"; 2 digits: "12+34=" -> "46\n"). A short SFT from
// scratch, on answers of which a share (`noise`) are replaced by random numbers, gives it the
// format and a policy that knows the sum but samples it only part of the time; RL then trains it
// with verify() as the reward.
#pragma once

#include <cstdint>
#include <filesystem>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "models/hf/config.hpp"

namespace troupe::examples {

struct addition_task {
  int digits = 1;               // of the operands (1: 0 to 9; 2: 10 to 99)
  bool partial_credit = false;  // verify: the share of characters in place, not 1 or 0
  static constexpr std::int32_t eos = '\n';

  // Prompts "a+b=" have one length; answers up to digits + 1 digits and the newline.
  std::int64_t prompt_len() const { return 2 * digits + 2; }
  std::int64_t max_new() const { return digits + 2; }

  // n prompts drawn from g, [n, prompt_len()] byte tokens.
  std::vector<std::int32_t> prompts(std::mt19937_64& g, std::int64_t n) const;

  // The verifier (a reward actor's C++ function). Exact: 1 when the completion is the sum and a
  // newline, else 0. Partial credit: the share of the answer's characters (newline included) the
  // completion has in place, 1 only for the exact answer.
  double verify(std::span<const std::int32_t> prompt,
                std::span<const std::int32_t> completion) const;

  // SFT from scratch (64 rows of prompt + answer per step, trained on the answer tokens), saved in
  // HF layout into `folder`; prints the answer loss's first and last values.
  std::filesystem::path sft(const std::filesystem::path& folder, std::int64_t steps,
                            std::uint64_t seed, double lr, double noise) const;
};

// The example's Llama: 2 layers of 64, byte vocabulary, 16 positions.
models::hf::model_config tiny_llama();

}  // namespace troupe::examples
