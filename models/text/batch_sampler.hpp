// Training batches as a pure function of (seed, step): row b of the batch of step s starts at an
// offset drawn from a splitmix64 stream of (seed, s, b), uniformly over the whole token stream.
// There are no epochs and no state, so a run resumed at step s sees exactly the batches it would
// have seen; the same sampler serves byte corpora (models/byte_data.hpp) and token files.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "memory/error.hpp"

namespace troupe::models {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// The first token of row `row` of the batch of `step`, for rows of t+1 tokens drawn from a stream
// of n_tokens (> t + 1) tokens.
inline std::uint64_t batch_row_start(std::uint64_t seed, std::uint64_t step, int row,
                                     std::uint64_t n_tokens, int t) {
  std::uint64_t r = splitmix64(splitmix64(seed) ^ splitmix64(step * 1315423911ull + row));
  return r % (n_tokens - static_cast<std::uint64_t>(t) - 1);
}

// Fills ids (resized to batch*(t+1)) with batch rows of t+1 consecutive tokens: the inputs are the
// first t of each row, the targets the last t. `what` names the token source in errors.
template <class Id>
void sample_batch_rows(std::span<const Id> tokens, const char* what, std::uint64_t seed,
                       std::uint64_t step, int batch, int t, std::vector<std::int32_t>& ids) {
  TROUPE_CHECK(batch > 0 && t > 0, "sample_batch: batch (", batch, ") and sequence length (", t,
               ") must be positive");
  TROUPE_CHECK(tokens.size() > static_cast<std::size_t>(t) + 1, "sample_batch: ", what, " of ",
               tokens.size(), " tokens is shorter than a row of ", t + 1, " tokens (+1)");
  const std::size_t row = static_cast<std::size_t>(t) + 1;
  ids.resize(static_cast<std::size_t>(batch) * row);
  for (int b = 0; b < batch; ++b) {
    const Id* src = tokens.data() + batch_row_start(seed, step, b, tokens.size(), t);
    std::int32_t* dst = ids.data() + static_cast<std::size_t>(b) * row;
    for (std::size_t i = 0; i < row; ++i) dst[i] = static_cast<std::int32_t>(src[i]);
  }
}

}  // namespace troupe::models
