// Tokenizers against reference fixtures made by HF transformers' GPT2Tokenizer and the Python
// sentencepiece package (scripts/reference/make_tokenizer_fixtures.py), plus round trips and
// errors.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <random>

#include "models/text/gpt2_pretokenize.hpp"
#include "models/text/tokenizer.hpp"
#include "models/text/unicode.hpp"

namespace fs = std::filesystem;
using namespace troupe::models;

namespace {

fs::path fixtures() {
  return fs::path(TROUPE_SOURCE_DIR) / "tests" / "fixtures" / "tokenizers";
}

nlohmann::json read_json(const fs::path& p) {
  std::ifstream in(p);
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

struct temp_dir {
  fs::path path;
  temp_dir() {
    static int n = 0;
    path = fs::temp_directory_path() /
           ("troupe-tok-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    fs::create_directories(path);
  }
  ~temp_dir() { fs::remove_all(path); }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(path / name, std::ios::binary) << text;
  }
};

std::string random_bytes(std::mt19937& gen, std::size_t n) {
  // A mix of ASCII, valid multi-byte UTF-8 and stray bytes.
  static const std::vector<std::string> atoms = {"a",
                                                 "Z",
                                                 "7",
                                                 " ",
                                                 "  ",
                                                 "\n",
                                                 "\t",
                                                 "'",
                                                 "'s",
                                                 "!",
                                                 "é",
                                                 "日",
                                                 "👍",
                                                 "\xC3",
                                                 "\x80",
                                                 "\xFF",
                                                 "\xE2\x80",
                                                 "\xF0\x9F\x98",
                                                 "\xED\xA0\x80",
                                                 "\xC0\xAF",
                                                 " x",
                                                 "\xC2\xA0"};
  std::string s;
  while (s.size() < n) s += atoms[gen() % atoms.size()];
  return s;
}

}  // namespace

TEST_CASE("GPT-2 pre-tokenization splits like the regex module", "[cpu]") {
  auto cases = read_json(fixtures() / "gpt2_cases.json")["cases"];
  REQUIRE(cases.size() > 30);
  for (const auto& c : cases) {
    auto text = c["text"].get<std::string>();
    std::vector<std::string> want = c["pieces"].get<std::vector<std::string>>();
    std::vector<std::string> got;
    for (auto p : gpt2_pretokenize(text)) got.emplace_back(p);
    INFO("text: " << text);
    CHECK(got == want);
  }
}

TEST_CASE("GPT-2 pre-tokenization covers arbitrary bytes exactly", "[cpu]") {
  std::mt19937 gen(7);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text = random_bytes(gen, 1 + gen() % 64);
    std::string joined;
    for (auto p : gpt2_pretokenize(text)) {
      CHECK(!p.empty());
      CHECK(p.data() == text.data() + joined.size());
      joined += p;
    }
    CHECK(joined == text);
  }
}

TEST_CASE("bytes_to_unicode is GPT-2's printable byte alphabet", "[cpu]") {
  auto map = gpt2_bytes_to_unicode();
  CHECK(map['!'] == U'!');
  CHECK(map['~'] == U'~');
  CHECK(map[' '] == U'\u0120');   // 'Ġ'
  CHECK(map['\n'] == U'\u010A');  // 'Ċ'
  CHECK(map[0] == U'\u0100');
  CHECK(map[0xAD] == U'\u0143');  // the soft hyphen is the last non-printable byte
  std::vector<char32_t> sorted(map.begin(), map.end());
  std::sort(sorted.begin(), sorted.end());
  CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end());
}

TEST_CASE("UTF-8 decoding takes valid sequences whole and invalid bytes one by one", "[cpu]") {
  char32_t cp;
  CHECK(decode_utf8("A", 0, cp) == 1);
  CHECK(cp == U'A');
  CHECK(decode_utf8("é", 0, cp) == 2);
  CHECK(cp == U'é');
  CHECK(decode_utf8("日", 0, cp) == 3);
  CHECK(cp == U'日');
  CHECK(decode_utf8("👍", 0, cp) == 4);
  CHECK(cp == U'👍');
  for (std::string bad : {"\x80", "\xC3", "\xC0\xAF", "\xE2\x80", "\xED\xA0\x80",
                          "\xF5\x80\x80\x80", "\xF4\x90\x80\x80", "\xFF"}) {
    INFO("bytes: " << bad.size());
    CHECK(decode_utf8(bad, 0, cp) == 1);
    CHECK(cp == U'\uFFFD');
  }
  std::string round;
  for (char32_t c : {U'a', U'ß', U'€', U'𝄞'}) append_utf8(round, c);
  CHECK(round == "aß€𝄞");
  CHECK(classify(U'a') == char_class::letter);
  CHECK(classify(U'日') == char_class::letter);
  CHECK(classify(U'٣') == char_class::number);
  CHECK(classify(U'\u3000') == char_class::space);
  CHECK(classify(U'\x1c') == char_class::other);    // str.isspace() says yes, the regex module no
  CHECK(classify(U'\u0301') == char_class::other);  // a combining mark
}

TEST_CASE("GPT-2 BPE encodes like HF GPT2Tokenizer", "[cpu]") {
  auto fx = read_json(fixtures() / "gpt2_cases.json");
  auto tok = load_tokenizer("gpt2:" + (fixtures() / "gpt2").string()).value();
  CHECK(tok->vocab_size() == fx["meta"]["vocab_size"].get<std::int64_t>());
  CHECK(tok->eos_id() == fx["meta"]["eos_id"].get<std::int32_t>());
  for (int pass = 0; pass < 2; ++pass) {  // the second pass runs from the cache
    for (const auto& c : fx["cases"]) {
      auto text = c["text"].get<std::string>();
      INFO("text: " << text);
      auto ids = tok->encode(text);
      CHECK(ids == c["ids"].get<std::vector<std::int32_t>>());
      CHECK(tok->decode(ids) == c["decoded"].get<std::string>());
      CHECK(tok->decode(ids) == text);
    }
  }
}

TEST_CASE("GPT-2 BPE decodes its encoding of arbitrary bytes back to the bytes", "[cpu]") {
  auto tok = load_gpt2_tokenizer((fixtures() / "gpt2").string());
  std::mt19937 gen(11);
  for (int trial = 0; trial < 200; ++trial) {
    std::string text = random_bytes(gen, 1 + gen() % 80);
    CHECK(tok->decode(tok->encode(text)) == text);
  }
}

TEST_CASE("SentencePiece encodes like the Python sentencepiece package", "[cpu]") {
  auto fx = read_json(fixtures() / "spm_cases.json");
  auto tok = load_tokenizer("spm:" + (fixtures() / "spm" / "tokenizer.model").string()).value();
  CHECK(tok->vocab_size() == fx["meta"]["vocab_size"].get<std::int64_t>());
  CHECK(tok->bos_id() == fx["meta"]["bos_id"].get<std::int32_t>());
  CHECK(tok->eos_id() == fx["meta"]["eos_id"].get<std::int32_t>());
  for (const auto& c : fx["cases"]) {
    auto text = c["text"].get<std::string>();
    INFO("text: " << text);
    auto ids = tok->encode(text);
    CHECK(ids == c["ids"].get<std::vector<std::int32_t>>());
    CHECK(tok->decode(ids) == c["decoded"].get<std::string>());
    CHECK(tok->decode(ids) == text);  // identity normalization and byte fallback: lossless
  }
}

TEST_CASE("The byte tokenizer maps bytes to ids 0 to 255 and back", "[cpu]") {
  auto tok = load_tokenizer("byte").value();
  CHECK(tok->vocab_size() == 256);
  CHECK(tok->eos_id() == -1);
  std::string text("h\xC3\xA9\x00\xFF\n", 6);
  auto ids = tok->encode(text);
  REQUIRE(ids.size() == text.size());
  for (std::size_t i = 0; i < text.size(); ++i)
    CHECK(ids[i] == static_cast<unsigned char>(text[i]));
  CHECK(tok->decode(ids) == text);
  std::vector<std::int32_t> bad = {65, 256};
  REQUIRE_THROWS_WITH(tok->decode(bad), Catch::Contains("id 256 at position 1"));
}

TEST_CASE("Tokenizer errors name the spec or file at fault", "[cpu]") {
  auto r = load_tokenizer("bpe:/nowhere");
  REQUIRE(!r.has_value());
  CHECK_THAT(r.error_message(), Catch::Contains("unknown tokenizer 'bpe:/nowhere'"));
  r = load_tokenizer("spm:/nowhere/tokenizer.model");
  REQUIRE(!r.has_value());
  CHECK_THAT(r.error_message(), Catch::Contains("/nowhere/tokenizer.model"));

  temp_dir d;
  std::string spec = "gpt2:" + d.path.string();
  r = load_tokenizer(spec);
  REQUIRE(!r.has_value());
  CHECK_THAT(r.error_message(), Catch::Contains("cannot open") && Catch::Contains("vocab.json"));

  d.write("vocab.json", "{\"a\": 0, \"b\": ");
  d.write("merges.txt", "#version: 0.2\na b\n");
  r = load_tokenizer(spec);
  REQUIRE(!r.has_value());
  CHECK_THAT(r.error_message(), Catch::Contains("vocab.json': not valid JSON"));

  d.write("vocab.json", "{\"a\": 0, \"b\": \"one\"}");
  CHECK_THAT(load_tokenizer(spec).error_message(),
             Catch::Contains("vocab.json") && Catch::Contains("token \"b\" has id \"one\""));

  d.write("vocab.json", "{\"a\": 0, \"b\": 0}");
  CHECK_THAT(load_tokenizer(spec).error_message(),
             Catch::Contains("vocab.json") && Catch::Contains("id 0 is used by two tokens"));

  d.write("vocab.json", "{\"a\": 0, \"b\": 1, \"ab\": 2}");
  d.write("merges.txt", "#version: 0.2\na b\nab\n");
  CHECK_THAT(load_tokenizer(spec).error_message(),
             Catch::Contains("merges.txt line 3") && Catch::Contains("expected two tokens"));

  d.write("merges.txt", "#version: 0.2\na \xC3\xA9\xC3\xA9\n");  // 'é' is U+00E9, fine; ' ' is not
  CHECK(load_tokenizer(spec).has_value());
  d.write("merges.txt", "a b\n\xE2\x82\xAC b\n");
  CHECK_THAT(load_tokenizer(spec).error_message(),
             Catch::Contains("merges.txt line 2") && Catch::Contains("byte alphabet"));

  // A piece the vocab lacks, with no <|endoftext|> to stand for it.
  d.write("merges.txt", "#version: 0.2\na b\n");
  auto tok = load_tokenizer(spec).value();
  CHECK(tok->encode("ab") == std::vector<std::int32_t>{2});
  CHECK(tok->encode("ba") == std::vector<std::int32_t>{1, 0});
  REQUIRE_THROWS_WITH(tok->encode("c"), Catch::Contains("is not in vocab.json"));
  std::vector<std::int32_t> bad = {3};
  REQUIRE_THROWS_WITH(tok->decode(bad), Catch::Contains("cannot decode id 3"));
}
