// GPT-2 byte-level BPE (HF GPT2Tokenizer semantics) from vocab.json and merges.txt.
//
// Tokens and merge parts are kept as raw byte strings (bytes_to_unicode inverted once, at load),
// interned as symbol ids; a merge maps a pair of symbols to its rank and the symbol of the joined
// string. Encoding a pre-tokenized piece starts from its bytes and repeatedly joins every
// occurrence of the lowest-ranked adjacent pair, left to right, as HF's GPT2Tokenizer.bpe does.
#include <nlohmann/json.hpp>

#include <climits>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <unordered_map>

#include "models/hf/bounded_json.hpp"
#include "models/text/gpt2_pretokenize.hpp"
#include "models/text/tokenizer.hpp"
#include "models/text/unicode.hpp"

namespace troupe::models {
namespace {
namespace fs = std::filesystem;

constexpr std::string_view kEndOfText = "<|endoftext|>";

std::string read_file(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  TROUPE_CHECK(in.good(), "gpt2 tokenizer: cannot open ", p.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class gpt2_tokenizer final : public tokenizer {
 public:
  explicit gpt2_tokenizer(const std::string& dir) : dir_(dir) {
    auto b2u = gpt2_bytes_to_unicode();
    for (int b = 0; b < 256; ++b) unicode_to_byte_[b2u[b]] = static_cast<unsigned char>(b);
    for (int b = 0; b < 256; ++b) byte_symbol_[b] = intern(std::string(1, static_cast<char>(b)));
    load_vocab(fs::path(dir) / "vocab.json");
    load_merges(fs::path(dir) / "merges.txt");
  }

  void encode(std::string_view text, std::vector<std::int32_t>& out) override {
    // HF splits on its special tokens first (here only <|endoftext|>), then pre-tokenizes each
    // part.
    while (!text.empty()) {
      std::size_t at = eot_id_ >= 0 ? text.find(kEndOfText) : std::string_view::npos;
      for (std::string_view piece : gpt2_pretokenize(text.substr(0, at))) encode_piece(piece, out);
      if (at == std::string_view::npos) break;
      out.push_back(eot_id_);
      text.remove_prefix(at + kEndOfText.size());
    }
  }

  std::string decode(std::span<const std::int32_t> ids) const override {
    std::string text;
    for (std::size_t i = 0; i < ids.size(); ++i) {
      std::int32_t id = ids[i];
      TROUPE_CHECK(id >= 0 && id < vocab_size() && has_id_[id], "gpt2 tokenizer ", dir_,
                   ": cannot decode id ", id, " at position ", i, ": it is not in vocab.json");
      text += id_text_[id];
    }
    return text;
  }

  std::int64_t vocab_size() const override { return static_cast<std::int64_t>(id_text_.size()); }
  std::int32_t bos_id() const override { return eot_id_; }
  std::int32_t eos_id() const override { return eot_id_; }
  std::string name() const override { return "gpt2:" + dir_; }

 private:
  struct merge {
    std::int32_t rank, result;
  };

  std::int32_t intern(const std::string& s) {
    auto [it, added] = symbols_.try_emplace(s, static_cast<std::int32_t>(symbol_vocab_.size()));
    if (added) symbol_vocab_.push_back(-1);
    return it->second;
  }

  // The bytes a token of the files stands for, or nothing when a character is outside the alphabet.
  std::optional<std::string> token_bytes(std::string_view token) const {
    std::string bytes;
    for (std::size_t i = 0; i < token.size();) {
      char32_t cp;
      i += decode_utf8(token, i, cp);
      auto it = unicode_to_byte_.find(cp);
      if (it == unicode_to_byte_.end()) return std::nullopt;
      bytes.push_back(static_cast<char>(it->second));
    }
    return bytes;
  }

  void load_vocab(const fs::path& path) {
    nlohmann::json vocab;
    try {
      vocab = hf::read_bounded_json(path, hf::vocab_json_bounds);
    } catch (const error& e) {
      TROUPE_FAIL("gpt2 tokenizer: ", e.what());
    }
    TROUPE_CHECK(vocab.is_object() && !vocab.empty(), "gpt2 tokenizer: ", path.string(),
                 " must be a non-empty JSON object of token -> id");
    std::int64_t max_id = -1;
    for (const auto& [token, id] : vocab.items())
      TROUPE_CHECK(id.is_number_integer() && id.get<std::int64_t>() >= 0 &&
                       id.get<std::int64_t>() < INT32_MAX,
                   "gpt2 tokenizer: ", path.string(), ": token \"", token, "\" has id ", id.dump(),
                   ", not a non-negative integer");
    for (const auto& [token, id] : vocab.items()) max_id = std::max(max_id, id.get<std::int64_t>());
    id_text_.assign(max_id + 1, {});
    has_id_.assign(max_id + 1, false);
    for (const auto& [token, id_json] : vocab.items()) {
      auto id = id_json.get<std::int32_t>();
      TROUPE_CHECK(!has_id_[id], "gpt2 tokenizer: ", path.string(), ": id ", id,
                   " is used by two tokens (\"", token, "\" is the second)");
      has_id_[id] = true;
      if (auto bytes = token_bytes(token)) {
        id_text_[id] = *bytes;
        symbol_vocab_[intern(*bytes)] = id;
      } else {
        id_text_[id] = token;  // outside the byte alphabet: only reachable as a special token
      }
      if (token == kEndOfText) eot_id_ = id;
    }
  }

  void load_merges(const fs::path& path) {
    std::string all = read_file(path);
    std::istringstream in(all);
    std::string line;
    for (int line_no = 1; std::getline(in, line); ++line_no) {
      if (line_no == 1 && line.starts_with("#version")) continue;
      std::istringstream fields(line);
      std::string a, b, extra;
      fields >> a >> b >> extra;
      if (a.empty()) continue;  // blank line
      TROUPE_CHECK(!b.empty() && extra.empty(), "gpt2 tokenizer: ", path.string(), " line ",
                   line_no, ": expected two tokens separated by a space, got \"", line, "\"");
      auto ab = token_bytes(a), bb = token_bytes(b);
      TROUPE_CHECK(ab && bb, "gpt2 tokenizer: ", path.string(), " line ", line_no, ": \"", line,
                   "\" has a character outside GPT-2's byte alphabet (bytes_to_unicode)");
      std::uint64_t key = pair_key(intern(*ab), intern(*bb));
      // As HF's dict(zip(merges, range(len(merges)))): a repeated pair keeps its last rank.
      merges_[key] = {rank_++, intern(*ab + *bb)};
    }
  }

  static std::uint64_t pair_key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) |
           static_cast<std::uint32_t>(b);
  }

  void encode_piece(std::string_view piece, std::vector<std::int32_t>& out) {
    auto cached = cache_.find(std::string(piece));
    if (cached != cache_.end()) {
      out.insert(out.end(), cached->second.begin(), cached->second.end());
      return;
    }
    std::vector<std::int32_t> word;
    word.reserve(piece.size());
    for (char c : piece) word.push_back(byte_symbol_[static_cast<unsigned char>(c)]);
    while (word.size() > 1) {
      const merge* best = nullptr;
      std::int32_t first = -1, second = -1;
      for (std::size_t i = 0; i + 1 < word.size(); ++i) {
        auto it = merges_.find(pair_key(word[i], word[i + 1]));
        if (it != merges_.end() && (!best || it->second.rank < best->rank)) {
          best = &it->second;
          first = word[i];
          second = word[i + 1];
        }
      }
      if (!best) break;
      std::size_t w = 0;
      for (std::size_t i = 0; i < word.size(); ++w) {
        if (word[i] == first && i + 1 < word.size() && word[i + 1] == second) {
          word[w] = best->result;
          i += 2;
        } else {
          word[w] = word[i++];
        }
      }
      word.resize(w);
    }
    std::vector<std::int32_t> ids;
    ids.reserve(word.size());
    for (std::int32_t sym : word) {
      std::int32_t id = symbol_vocab_[sym];
      if (id < 0) {  // HF: encoder.get(token, encoder.get(unk_token)), unk being <|endoftext|>
        TROUPE_CHECK(eot_id_ >= 0, "gpt2 tokenizer ", dir_, ": a piece of \"", piece,
                     "\" is not in vocab.json, and there is no ", kEndOfText, " to stand for it");
        id = eot_id_;
      }
      ids.push_back(id);
    }
    out.insert(out.end(), ids.begin(), ids.end());
    if (cache_.size() >= kMaxCache) cache_.clear();
    cache_.emplace(std::string(piece), std::move(ids));
  }

  static constexpr std::size_t kMaxCache = 1 << 17;

  std::string dir_;
  std::unordered_map<char32_t, unsigned char> unicode_to_byte_;
  std::int32_t byte_symbol_[256] = {};
  std::unordered_map<std::string, std::int32_t> symbols_;  // byte string -> symbol
  std::vector<std::int32_t> symbol_vocab_;                 // symbol -> vocab id, or -1
  std::unordered_map<std::uint64_t, merge> merges_;        // (symbol, symbol) -> merge
  std::int32_t rank_ = 0;
  std::vector<std::string> id_text_;  // vocab id -> bytes
  std::vector<bool> has_id_;
  std::int32_t eot_id_ = -1;
  std::unordered_map<std::string, std::vector<std::int32_t>> cache_;
};

}  // namespace

std::unique_ptr<tokenizer> load_gpt2_tokenizer(const std::string& dir) {
  return std::make_unique<gpt2_tokenizer>(dir);
}

}  // namespace troupe::models
