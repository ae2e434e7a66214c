// The byte-level tokenizer and load_tokenizer, which parses a tokenizer spec.
#include "models/text/tokenizer.hpp"

namespace troupe::models {
namespace {

class byte_tokenizer final : public tokenizer {
 public:
  void encode(std::string_view text, std::vector<std::int32_t>& out) override {
    for (char c : text) out.push_back(static_cast<unsigned char>(c));
  }
  std::string decode(std::span<const std::int32_t> ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      TROUPE_CHECK(ids[i] >= 0 && ids[i] < 256, "byte tokenizer: cannot decode id ", ids[i],
                   " at position ", i, ": byte ids lie in [0, 256)");
      text.push_back(static_cast<char>(ids[i]));
    }
    return text;
  }
  std::int64_t vocab_size() const override { return 256; }
  std::int32_t bos_id() const override { return -1; }
  std::int32_t eos_id() const override { return -1; }
  std::string name() const override { return "byte"; }
};

}  // namespace

std::unique_ptr<tokenizer> make_byte_tokenizer() {
  return std::make_unique<byte_tokenizer>();
}

expected<std::unique_ptr<tokenizer>> load_tokenizer(const std::string& spec) {
  using result = expected<std::unique_ptr<tokenizer>>;
  try {
    if (spec == "byte") return make_byte_tokenizer();
    if (spec.starts_with("gpt2:") && spec.size() > 5) return load_gpt2_tokenizer(spec.substr(5));
    if (spec.starts_with("spm:") && spec.size() > 4) return load_spm_tokenizer(spec.substr(4));
  } catch (const error& e) {
    return result::failure(e.what());
  }
  return result::failure("unknown tokenizer '" + spec +
                         "': expected byte, gpt2:<dir with vocab.json and merges.txt> or "
                         "spm:<tokenizer.model>");
}

}  // namespace troupe::models
