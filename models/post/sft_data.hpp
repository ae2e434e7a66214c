// sft_data: supervised fine-tuning rows from a JSONL file of conversations.
//
// Each line of the file is {"messages": [{"role": "system|user|assistant", "content": "..."},
// ...]}; blank lines are skipped. A conversation is rendered and tokenized by its chat template
// (chat_template.hpp), then conversations are packed into rows of `seq` tokens: first-fit in file
// order (each goes into the first row with room for it; a conversation is never split), or one
// per row without packing. Per token a row has
//   ids        the token (pad_id after the last conversation)
//   targets    the next token of the same conversation when that token is trained (an assistant
//              content or end-of-turn token), else ignore_index: the loss is only on assistant
//              tokens and never crosses from one conversation into the next
//   segments   0, 1, 2, ... per conversation in the row; the padding is one more segment. The
//              attention of a token sees only the earlier tokens of its own segment
//   positions  the position within the segment (restarting at 0 per conversation, HF's
//              position_ids for packed rows)
// Errors name the file and line: malformed JSON, a missing or non-string role or content, an
// unknown role, no messages, and a conversation longer than `seq` (unless truncate is set, which
// keeps its first `seq` tokens).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "memory/error.hpp"
#include "models/post/chat_template.hpp"
#include "models/text/tokenizer.hpp"

namespace troupe::models {

struct sft_conversation {
  std::vector<chat_message> messages;
  std::int64_t line = 0;  // 1-based line of the file
};

// One line's conversation; errors start with `where` ("data.jsonl:3").
expected<std::vector<chat_message>> parse_chat_line(std::string_view line, std::string_view where);
// Every conversation of a JSONL file; the first bad line's error names the file and line.
expected<std::vector<sft_conversation>> read_chat_jsonl(const std::string& path);

struct sft_options {
  chat_format format = chat_format::chatml;
  std::int64_t seq = 0;   // tokens per row
  bool pack = true;       // several conversations per row (first-fit), else one per row
  bool truncate = false;  // keep the first seq tokens of a longer conversation instead of refusing
  std::int32_t pad_id = 0;
  std::int32_t ignore_index = -100;
};

struct sft_rows {
  std::int64_t seq = 0;
  std::vector<std::int32_t> ids, targets, segments, positions;  // each [rows, seq]
  std::int64_t conversations = 0;
  std::int64_t trained_targets = 0;  // targets that are not ignore_index
  std::int64_t rows() const { return seq == 0 ? 0 : static_cast<std::int64_t>(ids.size()) / seq; }
};

// Packs tokenized conversations (each at most seq tokens) into rows.
sft_rows pack_chats(std::span<const tokenized_chat> chats, const sft_options& opt);

// Renders, tokenizes and packs the conversations of `file` (for messages).
expected<sft_rows> make_sft_rows(tokenizer& tok, const chat_specials& specials,
                                 std::span<const sft_conversation> conversations,
                                 const sft_options& opt, std::string_view file);

// Rows r = (step * batch + i) mod rows() for i < batch, written into the four [batch, seq]
// arrays (each resized).
void sft_batch(const sft_rows& rows, std::int64_t step, std::int64_t batch,
               std::vector<std::int32_t>& ids, std::vector<std::int32_t>& targets,
               std::vector<std::int32_t>& segments, std::vector<std::int32_t>& positions);

}  // namespace troupe::models
