// grpo_prompts: prompts, their answers and the verifier (grpo_prompts.hpp).
#include "models/post/grpo_prompts.hpp"

#include <algorithm>
#include <fstream>
#include <nlohmann/json.hpp>

#include "models/hf/bounded_json.hpp"

namespace troupe::models {
namespace {

constexpr hf::json_bounds line_bounds{"a prompts JSONL line", 16ull << 20, 8};

std::string trimmed(std::string_view s) {
  const auto ws = [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; };
  while (!s.empty() && ws(s.front())) s.remove_prefix(1);
  while (!s.empty() && ws(s.back())) s.remove_suffix(1);
  return std::string(s);
}

// The stop, in the texts compared: a control character appended to both (to the completion only
// when it stopped), so that it counts as one character in place.
constexpr char stop_mark = '\x1f';

}  // namespace

std::vector<std::int32_t> grpo_prompt_ids(tokenizer& tok, const grpo_prompt_style& style,
                                          std::span<const chat_message> messages) {
  TROUPE_CHECK(style.format.has_value(), "a prompt of messages needs a chat template");
  // The messages and an empty assistant turn; the ids before its first trained token (its end of
  // turn) are the prompt with the assistant's header: HF's add_generation_prompt.
  std::vector<chat_message> all(messages.begin(), messages.end());
  all.push_back({"assistant", ""});
  const tokenized_chat t = tokenize_chat(tok, style.specials, render_chat(*style.format, all));
  const auto first = std::find(t.trained.begin(), t.trained.end(), 1);
  return {t.ids.begin(), t.ids.begin() + (first - t.trained.begin())};
}

std::vector<std::int32_t> grpo_prompt_ids(tokenizer& tok, const grpo_prompt_style& style,
                                          const std::string& text) {
  if (!style.format) return tok.encode(text);
  const chat_message user{"user", text};
  return grpo_prompt_ids(tok, style, std::span<const chat_message>(&user, 1));
}

expected<std::int32_t> completion_stop(tokenizer& tok, const grpo_prompt_style& style) {
  if (style.format)
    return style.specials.id(*style.format == chat_format::chatml ? "<|im_end|>" : "<|eot_id|>");
  if (tok.eos_id() >= 0) return tok.eos_id();
  const auto nl = tok.encode("\n");
  if (nl.size() != 1)
    return expected<std::int32_t>::failure(
        "completions need a stop token: tokenizer " + tok.name() +
        " has no eos and \"\\n\" is not one token (set a chat template)");
  return nl.front();
}

std::vector<grpo_prompt> addition_prompts(int digits, tokenizer& tok,
                                          const grpo_prompt_style& style) {
  TROUPE_CHECK(digits == 1 || digits == 2, "addition: digits must be 1 or 2, got ", digits);
  const int lo = digits == 1 ? 0 : 10, hi = digits == 1 ? 9 : 99;
  std::vector<grpo_prompt> out;
  for (int a = lo; a <= hi; ++a)
    for (int b = lo; b <= hi; ++b)
      out.push_back({grpo_prompt_ids(tok, style, std::to_string(a) + "+" + std::to_string(b) + "="),
                     std::to_string(a + b)});
  return out;
}

expected<std::vector<grpo_prompt>> read_grpo_prompts(const std::string& path, tokenizer& tok,
                                                     const grpo_prompt_style& style,
                                                     std::int64_t max_prompt_tokens) {
  using out_t = expected<std::vector<grpo_prompt>>;
  std::ifstream in(path);
  if (!in) return out_t::failure(path + ": cannot be read");
  std::vector<grpo_prompt> out;
  std::map<std::vector<std::int32_t>, std::pair<std::string, std::int64_t>> seen;  // answer, line
  std::string line;
  try {
    for (std::int64_t n = 1; std::getline(in, line); ++n) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      const std::string where = path + ":" + std::to_string(n);
      const auto j = hf::parse_bounded_json(line, line_bounds, where);
      if (!j.is_object()) return out_t::failure(where + ": expected an object");
      for (const char* key : {"prompt", "answer"})
        if (!j.contains(key))
          return out_t::failure(where + ": the line has no \"" + key +
                                "\" (each line needs a prompt and the answer its verifier checks)");
      grpo_prompt p;
      const auto& a = j["answer"];
      if (a.is_string())
        p.answer = a.get<std::string>();
      else if (a.is_number())
        p.answer = a.dump();
      else
        return out_t::failure(where + ": \"answer\" must be a string or a number");
      const auto& q = j["prompt"];
      if (q.is_string()) {
        p.ids = grpo_prompt_ids(tok, style, q.get<std::string>());
      } else if (q.is_array()) {
        if (!style.format)
          return out_t::failure(where +
                                ": a prompt of messages needs a chat template (grpo.template, "
                                "--template)");
        std::vector<chat_message> msgs;
        for (const auto& m : q) {
          if (!m.is_object() || !m.contains("role") || !m["role"].is_string() ||
              !m.contains("content") || !m["content"].is_string())
            return out_t::failure(where +
                                  ": \"prompt\" holds a message without string role and content");
          const auto role = m["role"].get<std::string>();
          if (role != "system" && role != "user" && role != "assistant")
            return out_t::failure(where + ": unknown role '" + role +
                                  "' (system, user or assistant)");
          msgs.push_back({role, m["content"].get<std::string>()});
        }
        p.ids = grpo_prompt_ids(tok, style, msgs);
      } else {
        return out_t::failure(where + ": \"prompt\" must be a string or a list of messages");
      }
      const auto len = static_cast<std::int64_t>(p.ids.size());
      if (len == 0) return out_t::failure(where + ": the prompt is empty");
      if (len > max_prompt_tokens)
        return out_t::failure(where + ": the prompt is " + std::to_string(len) +
                              " tokens, longer than the " + std::to_string(max_prompt_tokens) +
                              " the sequence leaves for it (the model's positions less "
                              "grpo.max_new_tokens)");
      const auto [at, fresh] = seen.emplace(p.ids, std::pair{trimmed(p.answer), n});
      if (!fresh && at->second.first != trimmed(p.answer))
        return out_t::failure(where + ": the same prompt as line " +
                              std::to_string(at->second.second) + " with another answer ('" +
                              p.answer + "', not '" + at->second.first + "')");
      out.push_back(std::move(p));
    }
  } catch (const error& e) {
    return out_t::failure(e.what());
  }
  if (out.empty()) return out_t::failure(path + ": no prompts");
  return out;
}

double answer_reward(const std::string& completion, bool stopped, const std::string& answer,
                     bool partial) {
  std::string got = trimmed(completion), want = trimmed(answer);
  if (stopped) got.push_back(stop_mark);
  want.push_back(stop_mark);
  if (got == want) return 1.0;
  if (!partial) return 0.0;
  std::size_t right = 0;
  for (std::size_t i = 0; i < want.size() && i < got.size(); ++i) right += got[i] == want[i];
  return static_cast<double>(right) / static_cast<double>(std::max(want.size(), got.size()));
}

grpo_verifier::grpo_verifier(std::shared_ptr<const tokenizer> tok,
                             std::span<const grpo_prompt> prompts, std::int32_t stop, bool partial)
    : tok_(std::move(tok)), stop_(stop), partial_(partial) {
  TROUPE_CHECK(tok_ != nullptr, "grpo_verifier: no tokenizer");
  for (const auto& p : prompts) answers_.emplace(p.ids, p.answer);
}

double grpo_verifier::operator()(std::span<const std::int32_t> prompt,
                                 std::span<const std::int32_t> completion) const {
  const auto it = answers_.find(std::vector<std::int32_t>(prompt.begin(), prompt.end()));
  TROUPE_CHECK(it != answers_.end(), "grpo verifier: a prompt of ", prompt.size(),
               " tokens that is none of the job's prompts");
  const bool stopped = !completion.empty() && completion.back() == stop_;
  if (stopped) completion = completion.first(completion.size() - 1);
  for (auto id : completion)
    if (id < 0 || id >= tok_->vocab_size()) return 0.0;  // a special token: not an answer
  return answer_reward(tok_->decode(completion), stopped, it->second, partial_);
}

grpo_prompt_draw::grpo_prompt_draw(std::span<const grpo_prompt> prompts, std::int64_t per_step,
                                   std::uint64_t seed)
    : prompts_(prompts.begin(), prompts.end()), per_step_(per_step), g_(seed) {
  TROUPE_CHECK(!prompts_.empty() && per_step > 0, "grpo prompts: ", prompts_.size(), " prompts, ",
               per_step, " per step");
  for (std::size_t i = 0; i < prompts_.size(); ++i) {
    by_length_[prompts_[i].ids.size()].push_back(i);
    longest_ = std::max<std::int64_t>(longest_, static_cast<std::int64_t>(prompts_[i].ids.size()));
  }
}

std::vector<std::int32_t> grpo_prompt_draw::next() {
  std::uniform_int_distribution<std::size_t> any(0, prompts_.size() - 1);
  const std::vector<std::size_t>& same = by_length_.at(prompts_[any(g_)].ids.size());
  std::uniform_int_distribution<std::size_t> pick(0, same.size() - 1);
  std::vector<std::int32_t> out;
  for (std::int64_t i = 0; i < per_step_; ++i) {
    const auto& ids = prompts_[same[pick(g_)]].ids;
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

}  // namespace troupe::models
