// SentencePiece tokenizer (e.g. Llama's tokenizer.model) through libsentencepiece.
#include <sentencepiece_processor.h>

#include "models/text/tokenizer.hpp"

namespace troupe::models {
namespace {

class spm_tokenizer final : public tokenizer {
 public:
  explicit spm_tokenizer(const std::string& path) : path_(path) {
    auto status = sp_.Load(path);
    TROUPE_CHECK(status.ok(), "spm tokenizer: cannot load ", path, ": ", status.ToString());
  }

  void encode(std::string_view text, std::vector<std::int32_t>& out) override {
    std::vector<int> ids;
    auto status = sp_.Encode(text, &ids);
    TROUPE_CHECK(status.ok(), "spm tokenizer ", path_, ": encode failed: ", status.ToString());
    out.insert(out.end(), ids.begin(), ids.end());
  }

  std::string decode(std::span<const std::int32_t> ids) const override {
    for (std::size_t i = 0; i < ids.size(); ++i)
      TROUPE_CHECK(ids[i] >= 0 && ids[i] < vocab_size(), "spm tokenizer ", path_,
                   ": cannot decode id ", ids[i], " at position ", i, ": the vocab has ",
                   vocab_size(), " pieces");
    std::string text;
    auto status = sp_.Decode(std::vector<int>(ids.begin(), ids.end()), &text);
    TROUPE_CHECK(status.ok(), "spm tokenizer ", path_, ": decode failed: ", status.ToString());
    return text;
  }

  std::int64_t vocab_size() const override { return sp_.GetPieceSize(); }
  std::int32_t bos_id() const override { return sp_.bos_id(); }
  std::int32_t eos_id() const override { return sp_.eos_id(); }
  std::string name() const override { return "spm:" + path_; }

 private:
  std::string path_;
  sentencepiece::SentencePieceProcessor sp_;
};

}  // namespace

std::unique_ptr<tokenizer> load_spm_tokenizer(const std::string& model_path) {
  return std::make_unique<spm_tokenizer>(model_path);
}

}  // namespace troupe::models
