#include "models/data_source.hpp"

#include <cstdio>
#include <memory>

#include "models/byte_data.hpp"
#include "models/text/token_file.hpp"

namespace troupe::models {

// The samplers draw rows of t + 1 tokens; the trainer wants rows of seq tokens: t = seq - 1.
expected<data_source> open_data_source(const std::string& tokens_path, const std::string& text_path,
                                       std::int64_t vocab, std::uint64_t seed) {
  data_source ds;
  char size[64];
  if (!tokens_path.empty()) {
    auto opened = token_dataset::open(tokens_path, vocab);
    if (!opened) return expected<data_source>::failure(opened.error_message());
    auto set = std::make_shared<token_dataset>(std::move(opened.value()));
    std::snprintf(size, sizeof size, "%.2f M tokens", static_cast<double>(set->size()) / 1e6);
    ds.description = tokens_path + " (" + size + ")";
    ds.tokens = set->size();
    ds.rows = [set, seed](std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
      set->sample_batch(seed, draw, batch, seq - 1, rows);
    };
    return ds;
  }
  if (vocab < 256)
    return expected<data_source>::failure(
        "byte-level text needs a vocabulary of at least 256, the "
        "model has " +
        std::to_string(vocab));
  std::shared_ptr<std::vector<std::uint8_t>> corpus;
  try {
    corpus = std::make_shared<std::vector<std::uint8_t>>(read_text_corpus(text_path));
  } catch (const error& e) {
    return expected<data_source>::failure(e.what());
  }
  std::snprintf(size, sizeof size, "%.1f MB of text", static_cast<double>(corpus->size()) / 1e6);
  ds.description = text_path + " (" + size + ", byte-level tokens)";
  ds.tokens = corpus->size();
  ds.rows = [corpus, seed](std::uint64_t draw, int batch, int seq,
                           std::vector<std::int32_t>& rows) {
    sample_batch(*corpus, seed, draw, batch, seq - 1, rows);
  };
  return ds;
}

}  // namespace troupe::models
