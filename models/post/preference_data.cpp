// preference_data: preference pairs to rows (preference_data.hpp).
#include "models/post/preference_data.hpp"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/hf/bounded_json.hpp"

namespace troupe::models {
namespace {

constexpr hf::json_bounds line_bounds{"a preference JSONL line", 16ull << 20, 8};

struct side {
  std::vector<std::int32_t> ids;
  std::vector<std::uint8_t> response;
};

std::vector<chat_message> messages_of(const nlohmann::json& j, const std::string& where,
                                      const char* key) {
  std::vector<chat_message> out;
  for (const auto& m : j) {
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      throw error(where + ": \"" + key + "\" holds a message without string role and content");
    out.push_back({m["role"].get<std::string>(), m["content"].get<std::string>()});
  }
  return out;
}

side tokenize_side(const nlohmann::json& prompt, const nlohmann::json& answer, tokenizer& tok,
                   const chat_specials& specials, const preference_options& opt,
                   const std::string& where, const char* key) {
  side s;
  if (prompt.is_string() && answer.is_string()) {
    s.ids = tok.encode(prompt.get<std::string>());
    s.response.assign(s.ids.size(), 0);
    tok.encode(answer.get<std::string>(), s.ids);
    if (tok.eos_id() >= 0) s.ids.push_back(tok.eos_id());
    s.response.resize(s.ids.size(), 1);
    return s;
  }
  if (!prompt.is_array() || !answer.is_array())
    throw error(where + ": \"prompt\" and \"" + key +
                "\" must both be strings or both lists of messages");
  if (!opt.format)
    throw error(where + ": a conversational pair needs a chat template (--template)");
  const auto p = messages_of(prompt, where, "prompt");
  auto all = p;
  for (auto& m : messages_of(answer, where, key)) all.push_back(std::move(m));
  const tokenized_chat head = tokenize_chat(tok, specials, render_chat(*opt.format, p));
  const tokenized_chat t = tokenize_chat(tok, specials, render_chat(*opt.format, all));
  s.ids = t.ids;
  s.response.resize(t.ids.size());
  for (std::size_t i = 0; i < t.ids.size(); ++i)
    s.response[i] = i >= head.ids.size() && t.trained[i] ? 1 : 0;
  return s;
}

}  // namespace

expected<preference_rows> read_preference_jsonl(const std::string& path, tokenizer& tok,
                                                const chat_specials& specials,
                                                const preference_options& opt) {
  using out_t = expected<preference_rows>;
  if (opt.seq <= 1) return out_t::failure("preference data: seq must be > 1");
  std::ifstream in(path);
  if (!in) return out_t::failure(path + ": cannot be read");
  preference_rows rows;
  rows.seq = opt.seq;
  std::string line;
  try {
    for (std::int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = path + ":" + std::to_string(n);
      const auto j = hf::parse_bounded_json(line, line_bounds, where);
      if (!j.is_object()) return out_t::failure(where + ": expected an object");
      for (const char* key : {"prompt", "chosen", "rejected"})
        if (!j.contains(key))
          return out_t::failure(where + ": the pair has no \"" + key +
                                "\" (each line needs prompt, chosen and rejected)");
      for (const char* key : {"chosen", "rejected"}) {
        side s = tokenize_side(j["prompt"], j[key], tok, specials, opt, where, key);
        const auto len = static_cast<std::int64_t>(s.ids.size());
        if (len > opt.seq) {
          if (!opt.truncate)
            return out_t::failure(where + ": the " + key + " side is " + std::to_string(len) +
                                  " tokens, longer than the sequence length " +
                                  std::to_string(opt.seq) + " (raise seq or set truncate)");
          s.ids.resize(static_cast<std::size_t>(opt.seq));
          s.response.resize(static_cast<std::size_t>(opt.seq));
        }
        const std::size_t at = rows.ids.size();
        rows.ids.resize(at + static_cast<std::size_t>(opt.seq), opt.pad_id);
        rows.targets.resize(at + static_cast<std::size_t>(opt.seq), opt.ignore_index);
        std::copy(s.ids.begin(), s.ids.end(), rows.ids.begin() + static_cast<std::ptrdiff_t>(at));
        for (std::size_t i = 0; i + 1 < s.ids.size(); ++i)
          if (s.response[i + 1]) rows.targets[at + i] = s.ids[i + 1];
      }
    }
  } catch (const error& e) {
    return out_t::failure(e.what());
  }
  if (rows.pairs() == 0) return out_t::failure(path + ": no preference pairs");
  return rows;
}

void preference_batch(const preference_rows& rows, std::int64_t draw, std::int64_t pairs,
                      std::vector<std::int32_t>& ids, std::vector<std::int32_t>& targets) {
  const std::int64_t n = rows.pairs(), t = rows.seq;
  TROUPE_CHECK(n > 0 && pairs > 0, "preference data: no pairs to draw ", pairs, " from");
  ids.resize(static_cast<std::size_t>(2 * pairs * t));
  targets.resize(ids.size());
  for (std::int64_t i = 0; i < pairs; ++i) {
    const std::int64_t p = (draw * pairs + i) % n;
    for (std::int64_t s = 0; s < 2; ++s) {  // chosen into row i, rejected into row pairs + i
      const auto from = static_cast<std::ptrdiff_t>((2 * p + s) * t);
      const auto to = static_cast<std::ptrdiff_t>((s * pairs + i) * t);
      std::copy_n(rows.ids.begin() + from, t, ids.begin() + to);
      std::copy_n(rows.targets.begin() + from, t, targets.begin() + to);
    }
  }
}

}  // namespace troupe::models
