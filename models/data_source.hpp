// data_source: the training rows of a run, from a token file or from byte-level text, as the
// trainer's batch_source (a pure function of (seed, draw)).
#pragma once

#include <cstdint>
#include <string>

#include "models/trainer.hpp"

namespace troupe::models {

struct data_source {
  trainer::batch_source rows;  // rows of `seq` tokens for draw d
  std::string description;     // for logs: "fortunes (5.1 MB of text, byte-level)"
  std::uint64_t tokens = 0;
};

// tokens_path set: a token file whose ids must be < vocab; else text_path as bytes (vocab must be
// at least 256). Errors name the file.
expected<data_source> open_data_source(const std::string& tokens_path, const std::string& text_path,
                                       std::int64_t vocab, std::uint64_t seed);

}  // namespace troupe::models
