// Choosing the next token from logits: greedy, or sampling with temperature, top-k and top-p
// (nucleus), with HF's order of filters (temperature, then top-k, then top-p).
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace troupe::models {

struct sampling_options {
  bool greedy = false;
  double temperature = 1.0;  // > 0
  std::int64_t top_k = 0;    // 0: off
  double top_p = 1.0;        // (0, 1]; 1: off
};

class token_sampler {
 public:
  explicit token_sampler(const sampling_options& opt, std::uint64_t seed = 0);
  // The id drawn from one row of logits.
  std::int32_t next(std::span<const float> logits);

 private:
  sampling_options opt_;
  std::mt19937_64 gen_;
  std::vector<std::pair<double, std::int32_t>> scratch_;
};

}  // namespace troupe::models
