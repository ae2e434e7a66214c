// SFT data: chat templates against HF's apply_chat_template (tests/fixtures/post/chat_cases.json,
// made by scripts/reference/make_post_fixtures.py), the assistant-only mask, packing, and the
// errors of malformed JSONL naming the file and line.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <filesystem>
#include <fstream>

#include "models/post/chat_template.hpp"
#include "models/post/sft_data.hpp"

namespace fs = std::filesystem;
using namespace troupe;
using namespace troupe::models;

namespace {

fs::path source_dir() {
  return fs::path(TROUPE_SOURCE_DIR);
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

std::vector<chat_message> messages_of(const nlohmann::json& j) {
  std::vector<chat_message> out;
  for (const auto& m : j) out.push_back({m["role"], m["content"]});
  return out;
}

struct temp_file {
  fs::path path;
  explicit temp_file(const std::string& text) {
    static int n = 0;
    path = fs::temp_directory_path() /
           ("troupe-sft-" + std::to_string(::getpid()) + "-" + std::to_string(n++) + ".jsonl");
    std::ofstream(path) << text;
  }
  ~temp_file() { fs::remove(path); }
};

}  // namespace

TEST_CASE("chat templates render, tokenize and mask like HF apply_chat_template", "[cpu]") {
  const auto cases = read_json(source_dir() / "tests/fixtures/post/chat_cases.json");
  auto tok = load_tokenizer("gpt2:" + (source_dir() / "tests/fixtures/tokenizers/gpt2").string());
  REQUIRE(tok.has_value());
  REQUIRE(cases.size() == 6);
  for (const auto& c : cases) {
    const chat_format f = parse_chat_format(c["format"].get<std::string>()).value();
    const auto msgs = messages_of(c["messages"]);
    INFO(c["format"].get<std::string>() << ": " << c["text"].get<std::string>());
    CHECK(render_chat_text(f, msgs) == c["text"].get<std::string>());
    const chat_specials sp = chat_specials::appended(f, c["vocab"].get<std::int64_t>());
    for (const auto& [name, id] : c["specials"].items()) CHECK(sp.id(name) == id.get<int>());
    const tokenized_chat t = tokenize_chat(**tok, sp, render_chat(f, msgs));
    CHECK(t.ids == c["ids"].get<std::vector<std::int32_t>>());
    std::vector<int> mask(t.trained.begin(), t.trained.end());
    CHECK(mask == c["assistant_mask"].get<std::vector<int>>());
  }
}

TEST_CASE("an unknown chat template is refused naming the accepted ones", "[cpu][faults]") {
  auto f = parse_chat_format("alpaca");
  REQUIRE_FALSE(f.has_value());
  CHECK_THAT(f.error_message(), Catch::Contains("alpaca") && Catch::Contains("llama3 or chatml"));
  std::printf("faults: chat template alpaca -> refused: %s\n", f.error_message().c_str());
}

TEST_CASE("packing places conversations first-fit and targets only assistant tokens", "[cpu]") {
  // Three conversations of 5, 4 and 2 tokens into rows of 7: rows {0, 2} and {1}.
  auto chat = [](std::vector<std::int32_t> ids, std::vector<std::uint8_t> trained) {
    return tokenized_chat{std::move(ids), std::move(trained)};
  };
  const std::vector<tokenized_chat> chats{chat({10, 11, 12, 13, 14}, {0, 0, 1, 1, 0}),
                                          chat({20, 21, 22, 23}, {0, 1, 1, 1}),
                                          chat({30, 31}, {0, 1})};
  const sft_rows r = pack_chats(chats, {.seq = 7, .pack = true, .pad_id = 0});
  REQUIRE(r.rows() == 2);
  const std::int32_t x = -100;
  CHECK(r.ids == std::vector<std::int32_t>{10, 11, 12, 13, 14, 30, 31, 20, 21, 22, 23, 0, 0, 0});
  CHECK(r.targets == std::vector<std::int32_t>{x, 12, 13, x, x, 31, x, 21, 22, 23, x, x, x, x});
  CHECK(r.segments == std::vector<std::int32_t>{0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 1});
  CHECK(r.positions == std::vector<std::int32_t>{0, 1, 2, 3, 4, 0, 1, 0, 1, 2, 3, 0, 1, 2});
  CHECK(r.trained_targets == 6);

  const sft_rows one = pack_chats(chats, {.seq = 7, .pack = false});
  CHECK(one.rows() == 3);
  std::vector<std::int32_t> ids, targets, segments, positions;
  sft_batch(one, 1, 2, ids, targets, segments, positions);  // rows 2 and 0
  CHECK(std::vector<std::int32_t>(ids.begin(), ids.begin() + 3) ==
        std::vector<std::int32_t>{30, 31, 0});
  CHECK(ids[7] == 10);
}

TEST_CASE("a JSONL file of conversations becomes packed rows", "[cpu]") {
  temp_file f(
      R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})"
      "\n\n"
      R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"},)"
      R"( {"role": "assistant", "content": "b"}]})"
      "\n");
  auto convs = read_chat_jsonl(f.path.string());
  REQUIRE(convs.has_value());
  REQUIRE(convs->size() == 2);
  CHECK((*convs)[1].line == 3);
  auto tok = make_byte_tokenizer();
  const chat_specials sp = chat_specials::appended(chat_format::chatml, 256);
  auto rows =
      make_sft_rows(*tok, sp, *convs, {.format = chat_format::chatml, .seq = 64}, f.path.string());
  REQUIRE(rows.has_value());
  // "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n" is 1+5+2+1+1+1+10+2+1+1
  // = 25 tokens; the second is 1+7+1+1+1+1+5+1+1+1+1+10+1+1+1 = 34: both fit one row of 64.
  CHECK(rows->rows() == 1);
  CHECK(rows->conversations == 2);
  // Trained: "y", "o", <|im_end|> of the first; "b", <|im_end|> of the second.
  CHECK(rows->trained_targets == 5);
  CHECK(rows->ids[24] == 10);  // the first conversation ends with "\n"
  CHECK(rows->segments[24] == 0);
  CHECK(rows->segments[25] == 1);
  CHECK(rows->positions[25] == 0);
}

TEST_CASE("bad SFT data is refused naming the file and line", "[cpu][faults]") {
  const std::string ok = R"({"messages": [{"role": "user", "content": "hi"}]})";
  struct bad_case {
    std::string line, what;
  };
  const std::vector<bad_case> cases{
      {R"({"messages": [{"role": "user", "content": "hi"})", "not valid JSON"},
      {R"({"messages": [{"role": "user"}]})", "has no string \"content\""},
      {R"({"messages": [{"content": "x"}]})", "has no string \"role\""},
      {R"({"messages": [{"role": "tool", "content": "x"}]})", "unknown role 'tool'"},
      {R"({"messages": []})", "non-empty array"},
      {R"({"prompt": "x"})", "\"messages\""},
  };
  for (const bad_case& c : cases) {
    temp_file f(ok + "\n" + c.line + "\n");
    auto got = read_chat_jsonl(f.path.string());
    REQUIRE_FALSE(got.has_value());
    CHECK_THAT(got.error_message(),
               Catch::Contains(f.path.string() + ":2: ") && Catch::Contains(c.what));
    std::printf("faults: SFT line %s -> refused: %s\n", c.line.c_str(),
                got.error_message().c_str());
  }
  // A conversation longer than the sequence: refused with its line, or truncated on request.
  temp_file f(ok + "\n" + R"({"messages": [{"role": "assistant", "content": "a long answer"}]})");
  auto convs = read_chat_jsonl(f.path.string());
  REQUIRE(convs.has_value());
  auto tok = make_byte_tokenizer();
  const chat_specials sp = chat_specials::appended(chat_format::chatml, 256);
  sft_options opt{.format = chat_format::chatml, .seq = 16};
  auto rows = make_sft_rows(*tok, sp, *convs, opt, f.path.string());
  REQUIRE_FALSE(rows.has_value());
  CHECK_THAT(rows.error_message(), Catch::Contains(f.path.string() + ":2: ") &&
                                       Catch::Contains("longer than the sequence length 16"));
  std::printf("faults: SFT conversation over seq -> refused: %s\n", rows.error_message().c_str());
  opt.truncate = true;
  rows = make_sft_rows(*tok, sp, *convs, opt, f.path.string());
  REQUIRE(rows.has_value());
  CHECK(rows->rows() == 2);
}
