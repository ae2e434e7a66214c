// UTF-8 decoding and the three Unicode classes GPT-2's pre-tokenizer needs (\p{L}, \p{N}, \s).
// The class table (unicode_tables.inc) is generated from the `regex` module HF's tokenizer runs on,
// by scripts/reference/make_unicode_tables.py.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace troupe::models {

enum class char_class : std::uint8_t { other, letter, number, space };

// The class of a code point: letter (\p{L}), number (\p{N}), space (\s) or other.
char_class classify(char32_t cp);

// Decodes the UTF-8 sequence starting at s[i] (i < s.size()) into cp and returns its length in
// bytes. An invalid or truncated sequence (bad lead or continuation byte, overlong form, surrogate,
// beyond U+10FFFF) counts as one byte decoding to U+FFFD, so every byte of s is covered exactly
// once.
int decode_utf8(std::string_view s, std::size_t i, char32_t& cp);

// Appends the UTF-8 encoding of cp (at most U+10FFFF) to out.
template <class String>
void append_utf8(String& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

}  // namespace troupe::models
