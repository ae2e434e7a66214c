// sample_text: the few lines of generated text a training run prints at its end - `troupe train`
// (one process, launched, or with memory tiers) and the example actor scripts (apps/examples/).
// A prompt continued by `tokens` tokens sampled at temperature 0.8 from the 40 most likely
// (models/generation.hpp), decoded with the tokenizer the run's data was made with. The sampler's
// seed is the caller's (the run's train.seed), so a run's sample is reproducible.
#pragma once

#include <cstdint>
#include <string>

#include "models/causal_lm.hpp"
#include "models/generation.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/text/tokenizer.hpp"

namespace troupe::apps {

struct sample_options {
  std::string tokenizer = "byte";  // load_tokenizer's spec: byte, gpt2:DIR, spm:FILE
  std::string prompt = "The ";
  int tokens = 200;  // generated after the prompt (0: no sample)
  std::uint64_t seed = 1;
};

// How the tokens are drawn, for the line above the sample.
inline constexpr const char* sample_settings = "temperature 0.8, top-k 40";

// The prompt and the tokens generated after it by `model`, decoded.
inline std::string sample_text(models::causal_lm& model, const sample_options& o) {
  auto tok = models::load_tokenizer(o.tokenizer).value();
  auto ids = tok->encode(o.prompt);
  models::token_sampler sampler({.temperature = 0.8, .top_k = 40}, o.seed);
  auto out = models::generate(model, ids, o.tokens, sampler, tok->eos_id());
  ids.insert(ids.end(), out.begin(), out.end());
  return tok->decode(ids);
}

// sample_text of the model saved in `folder` (HF layout: a checkpoint of troupe train or of an
// actor script under any plan), built for batch 1 and `seq` positions.
inline std::string sample_checkpoint(const std::string& folder, std::int64_t seq,
                                     const sample_options& o) {
  auto cfg = models::hf::read_config(folder).value();
  auto model = models::make_causal_lm(cfg, {1, seq});
  models::hf::load_weights(folder, cfg, model->slots()).value();
  return sample_text(*model, o);
}

}  // namespace troupe::apps
