// GPT-2's pre-tokenization regex as a hand-written scanner, and bytes_to_unicode.
//
// The alternatives of the pattern are tried in order at each position, as a backtracking regex
// engine does; for this pattern that reduces to a few cases on the class of the current character
// and the next one (see the comments below).
#include "models/text/gpt2_pretokenize.hpp"

#include "models/text/unicode.hpp"

namespace troupe::models {
namespace {

struct code_point {
  std::size_t pos;  // byte offset in the text
  char32_t cp;
  char_class cls;
};

// The length (in code points) of 's 't 're 've 'm 'll 'd at c[i], or 0.
std::size_t contraction(const std::vector<code_point>& c, std::size_t i) {
  std::size_t n = c.size();
  if (c[i].cp != U'\'' || i + 1 >= n) return 0;
  char32_t a = c[i + 1].cp;
  if (a == U's' || a == U't' || a == U'm' || a == U'd') return 2;
  if (i + 2 >= n) return 0;
  char32_t b = c[i + 2].cp;
  if ((a == U'r' && b == U'e') || (a == U'v' && b == U'e') || (a == U'l' && b == U'l')) return 3;
  return 0;
}

}  // namespace

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
  std::vector<code_point> c;
  c.reserve(text.size());
  for (std::size_t i = 0; i < text.size();) {
    char32_t cp;
    int len = decode_utf8(text, i, cp);
    c.push_back({i, cp, classify(cp)});
    i += len;
  }
  const std::size_t n = c.size();
  auto offset = [&](std::size_t k) { return k < n ? c[k].pos : text.size(); };
  std::vector<std::string_view> pieces;
  std::size_t i = 0;
  while (i < n) {
    std::size_t j = i;
    if (std::size_t len = contraction(c, i)) {
      j = i + len;  // 's|'t|'re|'ve|'m|'ll|'d
    } else {
      // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional ' ' then a run of one class that
      // is not white space. (A ' ' followed by white space or the end matches none of them.)
      std::size_t k =
          (c[i].cp == U' ' && i + 1 < n && c[i + 1].cls != char_class::space) ? i + 1 : i;
      if (c[k].cls != char_class::space) {
        j = k + 1;
        while (j < n && c[j].cls == c[k].cls) ++j;
      } else {
        // '\s+(?!\S)': the white space run, less its last character when a non-space follows
        // (a run of one followed by a non-space fails it); then '\s+' takes the run whole.
        while (j < n && c[j].cls == char_class::space) ++j;
        if (j < n && j - i >= 2) --j;
      }
    }
    pieces.push_back(text.substr(c[i].pos, offset(j) - c[i].pos));
    i = j;
  }
  return pieces;
}

std::array<char32_t, 256> gpt2_bytes_to_unicode() {
  std::array<char32_t, 256> map{};
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    map[b] = printable ? static_cast<char32_t>(b) : next++;
  }
  return map;
}

}  // namespace troupe::models
