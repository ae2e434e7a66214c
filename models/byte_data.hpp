// Byte-level text data: the demo corpus as tokens 0..255, and batches drawn as a pure function of
// (seed, step), so a resumed run sees the batches it would have seen.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe::models {

// Reads text files (a file, or every regular file in a folder, in sorted order) into one byte
// stream. Files of the fortune(6) format are kept as text (the '%' separator lines become blank
// lines); binary index files (*.dat) are skipped. Throws troupe::error naming the path on failure.
std::vector<std::uint8_t> read_text_corpus(const std::string& path);

// Fills ids[b*(t+1) ...] with batch rows of t+1 consecutive tokens (inputs are the first t, targets
// the last t of each row) at offsets chosen by a splitmix64 stream of (seed, step, row): the
// sampler of models/text/batch_sampler.hpp, shared with token files.
void sample_batch(const std::vector<std::uint8_t>& corpus, std::uint64_t seed, std::uint64_t step,
                  int batch, int t, std::vector<std::int32_t>& ids);

}  // namespace troupe::models
