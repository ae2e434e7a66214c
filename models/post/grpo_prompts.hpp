// grpo_prompts: the prompts `troupe grpo` samples from, each with the answer its verifier checks,
// the verifier itself, and how a step draws its prompts.
//
// Prompts: either generated (addition_prompts: every "a+b=" of 1- or 2-digit operands, answer
// the sum) or read from a JSONL file (read_grpo_prompts), one {"prompt": P, "answer": A} per line
// with P a string or a list of messages (TRL's standard and conversational forms) and A a string
// (or a number, taken as JSON writes it). Without a chat template a string prompt is its raw text;
// with one (chat_template.hpp) a string is one user message, and the messages are rendered with
// the assistant's header after them (HF's add_generation_prompt).
//
// Completions end at a stop token (completion_stop): the template's end of turn (<|im_end|>,
// <|eot_id|>), else the tokenizer's eos, else a newline.
//
// The verifier (grpo_verifier) compares a completion, decoded without its stop token, to the
// prompt's answer, both trimmed of ASCII whitespace: "exact" gives 1 when they are equal and the
// completion stopped, else 0; "partial" gives the share of characters in place (the stop counts as
// one), 1 only for the exact answer. A completion holding a token the tokenizer cannot decode (a
// special token other than the stop) scores 0.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "memory/error.hpp"
#include "models/post/chat_template.hpp"
#include "models/text/tokenizer.hpp"

namespace troupe::models {

struct grpo_prompt {
  std::vector<std::int32_t> ids;
  std::string answer;
};

// How prompts become ids: raw text (no format), or rendered by a chat template.
struct grpo_prompt_style {
  std::optional<chat_format> format;
  chat_specials specials;  // the template's special tokens' ids (unused without a format)
};

// The ids of a prompt given as messages (format needed) or as text (one user message with a
// format, else the raw text).
std::vector<std::int32_t> grpo_prompt_ids(tokenizer& tok, const grpo_prompt_style& style,
                                          std::span<const chat_message> messages);
std::vector<std::int32_t> grpo_prompt_ids(tokenizer& tok, const grpo_prompt_style& style,
                                          const std::string& text);

// The completions' stop token; an error when the tokenizer has no eos and "\n" is not one token.
expected<std::int32_t> completion_stop(tokenizer& tok, const grpo_prompt_style& style);

// Every "a+b=" with operands of `digits` digits (1: 0-9, 2: 10-99), answer the sum.
std::vector<grpo_prompt> addition_prompts(int digits, tokenizer& tok,
                                          const grpo_prompt_style& style);

// Reads a prompts JSONL file. Errors name the file and line: malformed JSON, a missing or
// ill-typed "prompt" or "answer", messages without a template, an empty prompt, a prompt of more
// than max_prompt_tokens (the model's positions less the completion's), the same prompt with
// another answer than an earlier line's; and the file when it holds no prompt.
expected<std::vector<grpo_prompt>> read_grpo_prompts(const std::string& path, tokenizer& tok,
                                                     const grpo_prompt_style& style,
                                                     std::int64_t max_prompt_tokens);

// The reward function of the reward actor: the answer of a prompt's ids, checked as above.
class grpo_verifier {
 public:
  grpo_verifier(std::shared_ptr<const tokenizer> tok, std::span<const grpo_prompt> prompts,
                std::int32_t stop, bool partial);
  // Throws when the prompt is none of the prompts given.
  double operator()(std::span<const std::int32_t> prompt,
                    std::span<const std::int32_t> completion) const;

 private:
  std::shared_ptr<const tokenizer> tok_;
  std::map<std::vector<std::int32_t>, std::string> answers_;  // trimmed
  std::int32_t stop_;
  bool partial_;
};

// The score of a completion's text against an answer (the verifier's rule, on text).
double answer_reward(const std::string& completion, bool stopped, const std::string& answer,
                     bool partial);

// The prompts of each step: `per_step` prompts of one length (the rollout decodes them
// together), drawn with replacement: the length of a prompt drawn at random, then `per_step`
// prompts drawn at random among those of that length. Deterministic in the seed.
class grpo_prompt_draw {
 public:
  grpo_prompt_draw(std::span<const grpo_prompt> prompts, std::int64_t per_step, std::uint64_t seed);
  // [per_step, L] row-major, L the length of this step's prompts.
  std::vector<std::int32_t> next();
  std::int64_t longest() const { return longest_; }

 private:
  std::vector<grpo_prompt> prompts_;
  std::map<std::size_t, std::vector<std::size_t>> by_length_;
  std::int64_t per_step_, longest_ = 0;
  std::mt19937_64 g_;
};

}  // namespace troupe::models
