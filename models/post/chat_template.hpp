// chat_template: a conversation (system/user/assistant messages) rendered as HF's chat templates
// render it, tokenized with the template's special tokens, with the assistant-only loss mask.
//
//   llama3:  <|begin_of_text|> then per message
//            <|start_header_id|>role<|end_header_id|>\n\n trim(content)<|eot_id|>
//   chatml:  per message <|im_start|>role\n content<|im_end|>\n
//
// (trim: ASCII whitespace at both ends, as Jinja's `trim` on ASCII text.) The rendered text is
// exactly HF's apply_chat_template(tokenize=False) with these templates; the ids are
// apply_chat_template(tokenize=True) on a tokenizer that has the special tokens added
// (tests/fixtures/post/, scripts/reference/make_post_fixtures.py). The mask is TRL's
// assistant-only loss: 1 on an assistant message's content and its end-of-turn token
// (<|eot_id|>, <|im_end|>), 0 on everything else (headers, roles, the "\n" after <|im_end|>).
//
// Text between two special tokens is tokenized in one piece, as HF does. Where that piece holds a
// header and assistant content ("assistant\n" + content in ChatML), a token that straddles the
// boundary counts as content: the mask starts after the longest common prefix of the ids of the
// piece and of its header alone.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "memory/error.hpp"
#include "models/text/tokenizer.hpp"

namespace troupe::models {

enum class chat_format { llama3, chatml };

// "llama3" or "chatml"; the error names the accepted values.
expected<chat_format> parse_chat_format(std::string_view name);
const char* chat_format_name(chat_format f);

struct chat_message {
  std::string role;  // "system", "user" or "assistant"
  std::string content;
};

// One piece of a rendered conversation: a special token, or text.
struct chat_piece {
  std::string text;
  bool special = false;
  bool trained = false;  // part of an assistant turn's content or its end-of-turn token
};

std::vector<chat_piece> render_chat(chat_format f, std::span<const chat_message> messages);
// The pieces' texts joined: HF's apply_chat_template(tokenize=False).
std::string render_chat_text(chat_format f, std::span<const chat_message> messages);

// The special tokens a format uses, in the order HF's add_special_tokens would number them.
std::vector<std::string> chat_special_tokens(chat_format f);

// Ids of the special tokens: by default vocab, vocab + 1, ... in chat_special_tokens order (the
// tokens appended to a tokenizer's vocabulary, as HF's add_special_tokens does).
struct chat_specials {
  std::map<std::string, std::int32_t, std::less<>> ids;
  static chat_specials appended(chat_format f, std::int64_t vocab);
  std::int32_t id(std::string_view token) const;  // throws naming the token when it is missing
  std::int64_t end() const;                       // 1 + the largest id
};

struct tokenized_chat {
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> trained;  // per id: 1 on assistant content and end-of-turn tokens
};

tokenized_chat tokenize_chat(tokenizer& tok, const chat_specials& specials,
                             std::span<const chat_piece> pieces);

}  // namespace troupe::models
