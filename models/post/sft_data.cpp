// sft_data: JSONL conversations to packed rows (sft_data.hpp).
#include "models/post/sft_data.hpp"

#include <fstream>
#include <nlohmann/json.hpp>

#include "models/hf/bounded_json.hpp"

namespace troupe::models {
namespace {

// A line holds one conversation: objects in an array in an object.
constexpr hf::json_bounds line_bounds{"a chat JSONL line", 16ull << 20, 8};

template <class T>
expected<T> fail(std::string_view where, const std::string& what) {
  return expected<T>::failure(std::string(where) + ": " + what);
}

}  // namespace

expected<std::vector<chat_message>> parse_chat_line(std::string_view line, std::string_view where) {
  using out_t = std::vector<chat_message>;
  nlohmann::json j;
  try {
    j = hf::parse_bounded_json(line, line_bounds, where);
  } catch (const error& e) {
    return expected<out_t>::failure(e.what());  // "<where>: not valid JSON (...)"
  }
  if (!j.is_object() || !j.contains("messages"))
    return fail<out_t>(where, "expected an object with \"messages\"");
  const nlohmann::json& msgs = j["messages"];
  if (!msgs.is_array() || msgs.empty())
    return fail<out_t>(where, "\"messages\" must be a non-empty array");
  out_t out;
  for (std::size_t i = 0; i < msgs.size(); ++i) {
    const nlohmann::json& m = msgs[i];
    const std::string at = "message " + std::to_string(i);
    if (!m.is_object()) return fail<out_t>(where, at + " is not an object");
    for (const char* key : {"role", "content"})
      if (!m.contains(key) || !m[key].is_string())
        return fail<out_t>(where, at + " has no string \"" + key + "\"");
    chat_message c{m["role"].get<std::string>(), m["content"].get<std::string>()};
    if (c.role != "system" && c.role != "user" && c.role != "assistant")
      return fail<out_t>(
          where, at + " has the unknown role '" + c.role + "' (use system, user or assistant)");
    out.push_back(std::move(c));
  }
  return out;
}

expected<std::vector<sft_conversation>> read_chat_jsonl(const std::string& path) {
  using out_t = std::vector<sft_conversation>;
  std::ifstream in(path);
  if (!in) return expected<out_t>::failure(path + ": cannot be read");
  out_t out;
  std::string line;
  for (std::int64_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto msgs = parse_chat_line(line, path + ":" + std::to_string(n));
    if (!msgs) return expected<out_t>::failure(msgs.error_message());
    out.push_back({std::move(*msgs), n});
  }
  if (in.bad()) return expected<out_t>::failure(path + ": read error");
  if (out.empty()) return expected<out_t>::failure(path + ": no conversations");
  return out;
}

sft_rows pack_chats(std::span<const tokenized_chat> chats, const sft_options& opt) {
  TROUPE_CHECK(opt.seq > 1, "sft: the sequence length must be > 1, got ", opt.seq);
  // First-fit: rows[r] lists the chats placed in row r, free[r] its room left.
  std::vector<std::vector<std::size_t>> rows;
  std::vector<std::int64_t> free;
  for (std::size_t c = 0; c < chats.size(); ++c) {
    const auto n = static_cast<std::int64_t>(chats[c].ids.size());
    TROUPE_CHECK(n <= opt.seq, "sft: conversation ", c, " has ", n, " tokens, more than ", opt.seq);
    std::size_t r = 0;
    if (opt.pack)
      while (r < rows.size() && free[r] < n) ++r;
    else
      r = rows.size();
    if (r == rows.size()) {
      rows.emplace_back();
      free.push_back(opt.seq);
    }
    rows[r].push_back(c);
    free[r] -= n;
  }
  sft_rows out;
  out.seq = opt.seq;
  out.conversations = static_cast<std::int64_t>(chats.size());
  const std::size_t total = rows.size() * static_cast<std::size_t>(opt.seq);
  out.ids.assign(total, opt.pad_id);
  out.targets.assign(total, opt.ignore_index);
  out.segments.assign(total, 0);
  out.positions.assign(total, 0);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    std::size_t at = r * static_cast<std::size_t>(opt.seq);
    const std::size_t end = at + static_cast<std::size_t>(opt.seq);
    std::int32_t seg = 0;
    for (std::size_t c : rows[r]) {
      const tokenized_chat& t = chats[c];
      for (std::size_t i = 0; i < t.ids.size(); ++i, ++at) {
        out.ids[at] = t.ids[i];
        out.segments[at] = seg;
        out.positions[at] = static_cast<std::int32_t>(i);
        if (i + 1 < t.ids.size() && t.trained[i + 1]) {
          out.targets[at] = t.ids[i + 1];
          ++out.trained_targets;
        }
      }
      ++seg;
    }
    for (std::int32_t p = 0; at < end; ++at, ++p) {  // padding: one more segment
      out.segments[at] = seg;
      out.positions[at] = p;
    }
  }
  return out;
}

expected<sft_rows> make_sft_rows(tokenizer& tok, const chat_specials& specials,
                                 std::span<const sft_conversation> conversations,
                                 const sft_options& opt, std::string_view file) {
  if (opt.seq <= 1)
    return expected<sft_rows>::failure("sft: the sequence length must be > 1, got " +
                                       std::to_string(opt.seq));
  std::vector<tokenized_chat> chats;
  chats.reserve(conversations.size());
  for (const sft_conversation& c : conversations) {
    tokenized_chat t = tokenize_chat(tok, specials, render_chat(opt.format, c.messages));
    const auto n = static_cast<std::int64_t>(t.ids.size());
    if (n > opt.seq) {
      if (!opt.truncate)
        return expected<sft_rows>::failure(
            std::string(file) + ":" + std::to_string(c.line) + ": the conversation is " +
            std::to_string(n) + " tokens, longer than the sequence length " +
            std::to_string(opt.seq) + " (raise seq or set truncate to cut it)");
      t.ids.resize(static_cast<std::size_t>(opt.seq));
      t.trained.resize(static_cast<std::size_t>(opt.seq));
    }
    chats.push_back(std::move(t));
  }
  return pack_chats(chats, opt);
}

void sft_batch(const sft_rows& rows, std::int64_t step, std::int64_t batch,
               std::vector<std::int32_t>& ids, std::vector<std::int32_t>& targets,
               std::vector<std::int32_t>& segments, std::vector<std::int32_t>& positions) {
  const std::int64_t n = rows.rows(), t = rows.seq;
  TROUPE_CHECK(n > 0 && batch > 0, "sft: no rows to draw a batch of ", batch, " from");
  const auto len = static_cast<std::size_t>(batch * t);
  for (auto* v : {&ids, &targets, &segments, &positions}) v->resize(len);
  for (std::int64_t i = 0; i < batch; ++i) {
    const std::int64_t r = (step * batch + i) % n;
    const auto from = static_cast<std::ptrdiff_t>(r * t), to = static_cast<std::ptrdiff_t>(i * t);
    std::copy_n(rows.ids.begin() + from, t, ids.begin() + to);
    std::copy_n(rows.targets.begin() + from, t, targets.begin() + to);
    std::copy_n(rows.segments.begin() + from, t, segments.begin() + to);
    std::copy_n(rows.positions.begin() + from, t, positions.begin() + to);
  }
}

}  // namespace troupe::models
