// The two fixed parts of GPT-2's byte-level BPE: its pre-tokenization regex and the
// bytes_to_unicode map that turns every byte into a printable character (the alphabet of vocab.json
// and merges.txt).
#pragma once

#include <array>
#include <string_view>
#include <vector>

namespace troupe::models {

// Splits text into the matches of GPT-2's pattern (as HF runs it with the `regex` module)
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// implemented by hand over UTF-8. The pieces are views into text and cover it exactly, in order.
// Invalid UTF-8 bytes count as single 'other' characters.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

// bytes_to_unicode() of GPT-2's encoder.py: byte b -> code point. The printable bytes '!'..'~',
// U+00A1..U+00AC and U+00AE..U+00FF map to themselves, the other 68 bytes to U+0100.. in order.
std::array<char32_t, 256> gpt2_bytes_to_unicode();

}  // namespace troupe::models
