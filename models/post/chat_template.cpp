// chat_template: rendering and tokenizing conversations (chat_template.hpp).
#include "models/post/chat_template.hpp"

#include <algorithm>

namespace troupe::models {
namespace {

std::string_view trim_ascii(std::string_view s) {
  constexpr std::string_view ws = " \t\n\r\v\f";
  const auto b = s.find_first_not_of(ws);
  if (b == std::string_view::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

}  // namespace

expected<chat_format> parse_chat_format(std::string_view name) {
  if (name == "llama3") return chat_format::llama3;
  if (name == "chatml") return chat_format::chatml;
  return expected<chat_format>::failure("unknown chat template '" + std::string(name) +
                                        "' (use llama3 or chatml)");
}

const char* chat_format_name(chat_format f) {
  return f == chat_format::llama3 ? "llama3" : "chatml";
}

std::vector<std::string> chat_special_tokens(chat_format f) {
  if (f == chat_format::llama3)
    return {"<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"};
  return {"<|im_start|>", "<|im_end|>"};
}

std::vector<chat_piece> render_chat(chat_format f, std::span<const chat_message> messages) {
  std::vector<chat_piece> out;
  auto special = [&](const char* t, bool trained = false) { out.push_back({t, true, trained}); };
  auto text = [&](std::string t, bool trained = false) {
    if (!t.empty()) out.push_back({std::move(t), false, trained});
  };
  if (f == chat_format::llama3) special("<|begin_of_text|>");
  for (const chat_message& m : messages) {
    const bool a = m.role == "assistant";
    if (f == chat_format::llama3) {
      special("<|start_header_id|>");
      text(m.role);
      special("<|end_header_id|>");
      text("\n\n");
      text(std::string(trim_ascii(m.content)), a);
      special("<|eot_id|>", a);
    } else {
      special("<|im_start|>");
      text(m.role + "\n");
      text(m.content, a);
      special("<|im_end|>", a);
      text("\n");
    }
  }
  return out;
}

std::string render_chat_text(chat_format f, std::span<const chat_message> messages) {
  std::string s;
  for (const chat_piece& p : render_chat(f, messages)) s += p.text;
  return s;
}

chat_specials chat_specials::appended(chat_format f, std::int64_t vocab) {
  chat_specials s;
  std::int32_t next = static_cast<std::int32_t>(vocab);
  for (const std::string& t : chat_special_tokens(f)) s.ids[t] = next++;
  return s;
}

std::int32_t chat_specials::id(std::string_view token) const {
  const auto it = ids.find(token);
  TROUPE_CHECK(it != ids.end(), "chat template: no id for the special token ", token);
  return it->second;
}

std::int64_t chat_specials::end() const {
  std::int64_t e = 0;
  for (const auto& [t, i] : ids) e = std::max<std::int64_t>(e, i + 1);
  return e;
}

tokenized_chat tokenize_chat(tokenizer& tok, const chat_specials& specials,
                             std::span<const chat_piece> pieces) {
  tokenized_chat out;
  std::size_t i = 0;
  while (i < pieces.size()) {
    if (pieces[i].special) {
      out.ids.push_back(specials.id(pieces[i].text));
      out.trained.push_back(pieces[i].trained ? 1 : 0);
      ++i;
      continue;
    }
    // The text up to the next special token, in one piece; `head` is its untrained prefix.
    std::string all, head;
    bool any_trained = false;
    for (; i < pieces.size() && !pieces[i].special; ++i) {
      all += pieces[i].text;
      if (pieces[i].trained)
        any_trained = true;
      else if (!any_trained)
        head += pieces[i].text;
    }
    const std::vector<std::int32_t> ids = tok.encode(all);
    std::size_t cut = ids.size();
    if (any_trained) {
      const std::vector<std::int32_t> h = tok.encode(head);
      cut = static_cast<std::size_t>(
          std::mismatch(h.begin(), h.end(), ids.begin(), ids.end()).first - h.begin());
    }
    for (std::size_t j = 0; j < ids.size(); ++j) {
      out.ids.push_back(ids[j]);
      out.trained.push_back(j >= cut ? 1 : 0);
    }
  }
  return out;
}

}  // namespace troupe::models
