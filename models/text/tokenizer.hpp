// The tokenizer interface (text <-> token ids) and its three implementations: byte-level (ids
// 0..255 are the bytes; the demo's), GPT-2 byte-level BPE (vocab.json + merges.txt, HF
// GPT2Tokenizer semantics) and SentencePiece (a Llama tokenizer.model, through libsentencepiece).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "memory/error.hpp"

namespace troupe::models {

class tokenizer {
 public:
  virtual ~tokenizer() = default;

  // Appends the ids of text to out. Not thread-safe: implementations may cache.
  virtual void encode(std::string_view text, std::vector<std::int32_t>& out) = 0;
  // The text of ids. Throws troupe::error naming the id when one is outside the vocab.
  virtual std::string decode(std::span<const std::int32_t> ids) const = 0;

  // Ids lie in [0, vocab_size()).
  virtual std::int64_t vocab_size() const = 0;
  // The begin/end-of-sequence ids, or -1 when the tokenizer has none.
  virtual std::int32_t bos_id() const = 0;
  virtual std::int32_t eos_id() const = 0;
  // How the tokenizer was made, e.g. "gpt2:/path/to/dir" (the spec load_tokenizer takes).
  virtual std::string name() const = 0;

  std::vector<std::int32_t> encode(std::string_view text) {
    std::vector<std::int32_t> ids;
    encode(text, ids);
    return ids;
  }
};

// Ids 0..255 are the bytes of the text; no bos/eos. Decoding gives back the bytes exactly.
std::unique_ptr<tokenizer> make_byte_tokenizer();

// GPT-2 byte-level BPE from dir/vocab.json and dir/merges.txt with the semantics of HF's
// GPT2Tokenizer (add_prefix_space=False): text is split on the special token "<|endoftext|>" (when
// the vocab has it; it is also bos, eos and unk), each piece is pre-tokenized by GPT-2's regex,
// mapped through bytes_to_unicode and merged by rank. Decoding returns the raw bytes of the tokens
// (no U+FFFD replacement, no clean-up of spaces), so decode(encode(x)) == x for every x.
// Throws troupe::error naming the file and entry when vocab.json or merges.txt is malformed.
std::unique_ptr<tokenizer> load_gpt2_tokenizer(const std::string& dir);

// A SentencePiece model (e.g. Llama's tokenizer.model): encode/decode as ids through
// libsentencepiece, with no bos/eos added by encode.
std::unique_ptr<tokenizer> load_spm_tokenizer(const std::string& model_path);

// A tokenizer from a spec: "byte", "gpt2:<dir with vocab.json + merges.txt>" or
// "spm:<tokenizer.model>". The failure message names the spec or the file at fault.
expected<std::unique_ptr<tokenizer>> load_tokenizer(const std::string& spec);

}  // namespace troupe::models
