// troupe grpo's prompts (grpo_prompts.hpp): the generated addition prompts, chat prompts ending
// with the assistant's header (HF's add_generation_prompt), the verifier's rule, the JSONL reader
// and its errors naming the file and line, and each step's draw of prompts of one length.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "models/post/grpo_prompts.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::models;
using Catch::Contains;

namespace {

std::shared_ptr<tokenizer> bytes() {
  return load_tokenizer("byte").value();
}

grpo_prompt_style style_of(chat_format f) {
  return {f, chat_specials::appended(f, 256)};
}

std::vector<std::int32_t> ids_of(const std::string& s) {
  return {s.begin(), s.end()};
}

struct jsonl_file {
  std::string path;
  explicit jsonl_file(const std::string& text)
      : path((fs::temp_directory_path() / ("grpo-prompts-" + std::to_string(::getpid()) + "-" +
                                           std::to_string(next++) + ".jsonl"))
                 .string()) {
    std::ofstream(path) << text;
  }
  ~jsonl_file() { fs::remove(path); }
  static inline int next = 0;
};

}  // namespace

TEST_CASE("addition prompts are every a+b= of the digits with its sum", "[cpu]") {
  auto tok = bytes();
  const auto one = addition_prompts(1, *tok, {});
  REQUIRE(one.size() == 100);
  CHECK(one[3 * 10 + 5].ids == ids_of("3+5="));
  CHECK(one[3 * 10 + 5].answer == "8");
  const auto two = addition_prompts(2, *tok, {});
  REQUIRE(two.size() == 90 * 90);
  CHECK(two.back().ids == ids_of("99+99="));
  CHECK(two.back().answer == "198");
  for (const auto& p : two) CHECK(p.ids.size() == 6);
}

TEST_CASE("a chat prompt ends with the assistant's header, as HF's add_generation_prompt",
          "[cpu]") {
  auto tok = bytes();
  for (const chat_format f : {chat_format::chatml, chat_format::llama3}) {
    const auto st = style_of(f);
    const std::vector<chat_message> msgs{{"system", "Be terse."}, {"user", "What is 2 plus 9?"}};
    // The conversation as the template renders it, then the generation prompt HF's templates
    // add: "<|im_start|>assistant\n" (ChatML) or
    // "<|start_header_id|>assistant<|end_header_id|>\n\n" (Llama 3).
    auto want = tokenize_chat(*tok, st.specials, render_chat(f, msgs)).ids;
    if (f == chat_format::chatml) {
      want.push_back(st.specials.id("<|im_start|>"));
      tok->encode("assistant\n", want);
    } else {
      want.push_back(st.specials.id("<|start_header_id|>"));
      tok->encode("assistant", want);
      want.push_back(st.specials.id("<|end_header_id|>"));
      tok->encode("\n\n", want);
    }
    CHECK(grpo_prompt_ids(*tok, st, msgs) == want);
    // A string is one user message.
    CHECK(grpo_prompt_ids(*tok, st, std::string("hi")) ==
          grpo_prompt_ids(*tok, st, std::vector<chat_message>{{"user", "hi"}}));
    CHECK(completion_stop(*tok, st).value() ==
          st.specials.id(f == chat_format::chatml ? "<|im_end|>" : "<|eot_id|>"));
  }
  CHECK(grpo_prompt_ids(*tok, {}, std::string("3+5=")) == ids_of("3+5="));
  CHECK(completion_stop(*tok, {}).value() == '\n');  // no eos in the byte tokenizer
}

TEST_CASE("the verifier gives 1 only to the exact answer that stopped, partial the share",
          "[cpu]") {
  auto tok = bytes();
  const auto prompts = addition_prompts(1, *tok, {});
  const grpo_verifier exact(tok, prompts, '\n', false), partial(tok, prompts, '\n', true);
  const auto p = ids_of("3+5=");
  CHECK(exact(p, ids_of("8\n")) == 1.0);
  CHECK(exact(p, ids_of(" 8 \n")) == 1.0);  // trimmed
  CHECK(exact(p, ids_of("8")) == 0.0);      // cut at max_new_tokens before the stop
  CHECK(exact(p, ids_of("88\n")) == 0.0);
  CHECK(exact(p, ids_of("9\n")) == 0.0);
  CHECK(partial(p, ids_of("8\n")) == 1.0);
  CHECK(partial(p, ids_of("9\n")) == 0.5);               // "9|" against "8|": the stop in place
  CHECK(partial(p, ids_of("8")) == 0.5);                 // "8" against "8|"
  CHECK(partial(p, ids_of("88\n")) == Approx(1.0 / 3));  // "88|" against "8|"
  CHECK(exact(p, std::vector<std::int32_t>{'8', 300, '\n'}) == 0.0);  // a special token inside
  CHECK_THROWS_WITH(exact(ids_of("3+6"), ids_of("9\n")), Contains("none of the job's prompts"));
  CHECK(answer_reward("11", true, " 11\n", false) == 1.0);
}

TEST_CASE("a prompts JSONL file takes strings and messages with their answers", "[cpu]") {
  auto tok = bytes();
  const jsonl_file f(
      R"({"prompt": "What is 2 plus 9?", "answer": "11"})"
      "\n\n"
      R"({"prompt": [{"role": "user", "content": "What is 3 times 3?"}], "answer": 9})"
      "\n");
  const auto st = style_of(chat_format::chatml);
  const auto ps = read_grpo_prompts(f.path, *tok, st, 100).value();
  REQUIRE(ps.size() == 2);
  CHECK(ps[0].ids == grpo_prompt_ids(*tok, st, std::string("What is 2 plus 9?")));
  CHECK(ps[0].answer == "11");
  CHECK(ps[1].answer == "9");  // a number, as JSON writes it
  // Without a template the string is raw text.
  const jsonl_file raw(R"({"prompt": "1+1=", "answer": "2"})"
                       "\n");
  CHECK(read_grpo_prompts(raw.path, *tok, {}, 100).value()[0].ids == ids_of("1+1="));
}

TEST_CASE("bad prompts JSONL lines are refused naming the file and line", "[cpu][faults]") {
  auto tok = bytes();
  const auto refused = [&](const std::string& text, const grpo_prompt_style& st,
                           std::int64_t max_prompt = 100) {
    const jsonl_file f(text);
    const auto r = read_grpo_prompts(f.path, *tok, st, max_prompt);
    REQUIRE_FALSE(r.has_value());
    std::printf("faults: prompts JSONL -> refused: %s\n", r.error_message().c_str());
    CHECK_THAT(r.error_message(), Contains(f.path));
    return r.error_message().substr(f.path.size());
  };
  const std::string ok = R"({"prompt": "1+1=", "answer": "2"})"
                         "\n";
  CHECK_THAT(refused(ok + "{\"prompt\": \n", {}), Contains(":2: not valid JSON"));
  CHECK_THAT(refused(ok + R"({"prompt": "2+2="})"
                          "\n",
                     {}),
             Contains(":2: the line has no \"answer\""));
  CHECK_THAT(refused(R"({"answer": "2"})", {}), Contains(":1: the line has no \"prompt\""));
  CHECK_THAT(refused(R"({"prompt": "12345", "answer": "2"})", {}, 4),
             Contains(":1: the prompt is 5 tokens, longer than the 4 the sequence leaves"));
  CHECK_THAT(refused(R"({"prompt": [{"role": "user", "content": "q"}], "answer": "2"})", {}),
             Contains(":1: a prompt of messages needs a chat template"));
  CHECK_THAT(refused(R"({"prompt": [{"role": "robot", "content": "q"}], "answer": "2"})",
                     style_of(chat_format::chatml)),
             Contains(":1: unknown role 'robot'"));
  CHECK_THAT(refused(R"({"prompt": 5, "answer": "2"})", {}),
             Contains(":1: \"prompt\" must be a string or a list of messages"));
  CHECK_THAT(refused(R"({"prompt": "q", "answer": ["2"]})", {}),
             Contains(":1: \"answer\" must be a string or a number"));
  CHECK_THAT(refused(R"({"prompt": "", "answer": "2"})", {}), Contains(":1: the prompt is empty"));
  CHECK_THAT(refused(ok + R"({"prompt": "1+1=", "answer": "3"})"
                          "\n",
                     {}),
             Contains(":2: the same prompt as line 1 with another answer ('3', not '2')"));
  CHECK_THAT(refused("\n", {}), Contains(": no prompts"));
  CHECK_THAT(refused("[1, 2]\n", {}), Contains(":1: expected an object"));
}

TEST_CASE("each step draws prompts of one length, the same for a seed", "[cpu]") {
  auto tok = bytes();
  std::vector<grpo_prompt> ps;
  for (const char* s : {"a", "b", "c", "dd", "ee", "fff"}) ps.push_back({ids_of(s), "x"});
  grpo_prompt_draw d1(ps, 4, 7), d2(ps, 4, 7);
  CHECK(d1.longest() == 3);
  std::set<std::size_t> lengths;
  for (int k = 0; k < 40; ++k) {
    const auto a = d1.next();
    CHECK(a == d2.next());
    REQUIRE(a.size() % 4 == 0);
    const std::size_t len = a.size() / 4;
    lengths.insert(len);
    for (std::size_t r = 0; r < 4; ++r) {  // each row is one of the prompts of that length
      const std::vector<std::int32_t> row(a.begin() + static_cast<std::ptrdiff_t>(r * len),
                                          a.begin() + static_cast<std::ptrdiff_t>((r + 1) * len));
      CHECK(std::any_of(ps.begin(), ps.end(), [&](const auto& p) { return p.ids == row; }));
    }
  }
  CHECK(lengths == std::set<std::size_t>{1, 2, 3});  // every length comes up
}
