// preference_data: preference pairs from a JSONL file, tokenized into the rows DPO and the reward
// model train on.
//
// Each line is {"prompt": P, "chosen": C, "rejected": R} in one of TRL's two forms:
//   standard        P, C, R are strings: the ids are encode(P) then encode(C) (or R), and the
//                   tokenizer's eos (when it has one) ends the response
//   conversational  P is a list of messages and C, R lists of (assistant) messages: the ids are
//                   the chat template's rendering of P + C (chat_template.hpp)
// The response tokens (those of C or R: in the conversational form the template's assistant
// tokens past the prompt) are the ones whose log-probabilities DPO sums. Errors name the file and
// line: malformed JSON, a missing or ill-typed side, a pair longer than the sequence (unless
// truncate, which keeps the first seq tokens).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "memory/error.hpp"
#include "models/post/chat_template.hpp"
#include "models/text/tokenizer.hpp"

namespace troupe::models {

struct preference_options {
  std::optional<chat_format> format;  // needed by the conversational form
  std::int64_t seq = 0;
  bool truncate = false;
  std::int32_t pad_id = 0;
  std::int32_t ignore_index = -100;
};

// Rows of seq tokens: pair i's chosen response in row 2i, its rejected one in row 2i + 1.
// targets: the next token where that token is a response token, else ignore_index.
struct preference_rows {
  std::int64_t seq = 0;
  std::vector<std::int32_t> ids, targets;
  std::int64_t pairs() const {
    return seq == 0 ? 0 : static_cast<std::int64_t>(ids.size()) / (2 * seq);
  }
};

expected<preference_rows> read_preference_jsonl(const std::string& path, tokenizer& tok,
                                                const chat_specials& specials,
                                                const preference_options& opt);

// Pairs (draw * pairs + i) mod pairs() for i < pairs: ids and targets [2 * pairs, seq], the
// chosen rows first (rows 0 .. pairs-1), then the rejected ones in the same order.
void preference_batch(const preference_rows& rows, std::int64_t draw, std::int64_t pairs,
                      std::vector<std::int32_t>& ids, std::vector<std::int32_t>& targets);

}  // namespace troupe::models
