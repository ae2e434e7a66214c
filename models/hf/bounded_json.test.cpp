// Every JSON file troupe reads is bounded in size and nesting (bounded_json.hpp): config.json, a
// shard index, trainer_state.json, a safetensors header and a GPT-2 vocab.json over a bound are
// refused naming the file and the bound, and one right at the bound is read.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>

#include "models/hf/bounded_json.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/config.hpp"
#include "models/hf/safetensors.hpp"
#include "models/hf/testing.hpp"
#include "models/hf/training_state.hpp"
#include "models/text/tokenizer.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::hf;
using namespace troupe::models::hf::testing;
using Catch::Contains;

namespace {

// `depth` arrays nested in one another: "[[[]]]" is depth 3.
std::string nested(int depth) {
  return std::string(static_cast<std::size_t>(depth), '[') +
         std::string(static_cast<std::size_t>(depth), ']');
}

// A JSON object of at least `bytes` bytes: {"pad": "xxxx..."}.
std::string padded(std::uint64_t bytes) {
  return R"({"pad": ")" + std::string(static_cast<std::size_t>(bytes), 'x') + R"("})";
}

}  // namespace

TEST_CASE("Depth and size bounds hold exactly at the bound", "[cpu]") {
  const json_bounds b{"a test file", 64, 3};
  CHECK(parse_bounded_json(nested(3), b, "'t'").is_array());
  CHECK_THROWS_WITH(parse_bounded_json(nested(4), b, "'t'"),
                    Contains("'t': nested deeper than 3 levels, the bound for a test file"));
  CHECK(parse_bounded_json(R"({"a": {"b": [1]}})", b, "'t'").is_object());
  CHECK_THROWS_WITH(parse_bounded_json(R"({"a": {"b": [{}]}})", b, "'t'"),
                    Contains("nested deeper than 3"));
  CHECK(parse_bounded_json(std::string(60, ' ') + "[1]", b, "'t'").is_array());  // 63 bytes
  CHECK_THROWS_WITH(parse_bounded_json(std::string(62, ' ') + "[1]", b, "'t'"),
                    Contains("65 bytes, more than the 64 bytes bound for a test file"));
  CHECK_THROWS_WITH(parse_bounded_json("[1, 2", b, "'t'"), Contains("'t': not valid JSON"));
}

TEST_CASE("An over-deep or over-large config.json is refused naming the file and the bound",
          "[cpu][faults]") {
  temp_dir tmp;
  const fs::path file = tmp / "config.json";
  write_bytes(file, R"({"model_type": "gpt2", "task_specific_params": )" + nested(40) + "}");
  auto deep = read_config(file);
  REQUIRE_FALSE(deep.has_value());
  CHECK_THAT(deep.error_message(), Contains(file.string()) &&
                                       Contains("nested deeper than 32 levels") &&
                                       Contains("the bound for config.json"));
  std::printf("faults: config.json nested 41 deep -> refused: %s\n", deep.error_message().c_str());
  // A million levels: refused as quickly, no stack overflow.
  write_bytes(file, nested(1'000'000));
  CHECK_THAT(read_config(file).error_message(), Contains("nested deeper than 32 levels"));
  write_bytes(file, padded(5 << 20));
  auto large = read_config(file);
  REQUIRE_FALSE(large.has_value());
  CHECK_THAT(large.error_message(),
             Contains(file.string()) && Contains("more than the 4 MiB bound for config.json"));
  std::printf("faults: config.json of 5 MiB -> refused: %s\n", large.error_message().c_str());
}

TEST_CASE("Over-deep shard indexes, trainer states and vocabularies are refused by name",
          "[cpu][faults]") {
  temp_dir tmp;
  // A shard index (the folder's weights are looked for only through it).
  const fs::path index = tmp / "model.safetensors.index.json";
  write_bytes(index, R"({"weight_map": {}, "metadata": )" + nested(20) + "}");
  const slot_list none;
  auto w = read_weights(tmp.path(), name_map{}, none, [](const auto&, const auto&) {});
  REQUIRE_FALSE(w.has_value());
  CHECK_THAT(w.error_message(), Contains(index.string()) && Contains("deeper than 16 levels"));
  std::printf("faults: shard index nested 21 deep -> refused: %s\n", w.error_message().c_str());
  // trainer_state.json.
  write_bytes(tmp / "optimizer.safetensors", raw_safetensors("{}", ""));
  write_bytes(tmp / "trainer_state.json", R"({"extra": )" + nested(40) + "}");
  auto st = training_state_file::open(tmp.path(), shape{4});
  REQUIRE_FALSE(st.has_value());
  CHECK_THAT(st.error_message(),
             Contains((tmp / "trainer_state.json").string()) && Contains("deeper than 32 levels"));
  write_bytes(tmp / "trainer_state.json", padded(17 << 20));
  CHECK_THAT(training_state_file::open(tmp.path(), shape{4}).error_message(),
             Contains("more than the 16 MiB bound for trainer_state.json"));
  // A GPT-2 vocab.json.
  write_bytes(tmp / "vocab.json", R"({"a": 0, "b": )" + nested(9) + "}");
  write_bytes(tmp / "merges.txt", "#version: 0.2\n");
  auto tok = load_tokenizer("gpt2:" + tmp.path().string());
  REQUIRE_FALSE(tok.has_value());
  CHECK_THAT(tok.error_message(), Contains((tmp / "vocab.json").string()) &&
                                      Contains("deeper than 8 levels") &&
                                      Contains("a tokenizer vocabulary"));
  std::printf("faults: vocab.json nested 10 deep -> refused: %s\n", tok.error_message().c_str());
}

TEST_CASE("A safetensors header nested too deep is refused naming the file", "[cpu][faults]") {
  temp_dir tmp;
  const fs::path file = tmp / "model.safetensors";
  write_bytes(file, raw_safetensors(R"({"__metadata__": )" + nested(17) + "}", ""));
  auto f = safetensors_file::open(file);
  REQUIRE_FALSE(f.has_value());
  CHECK_THAT(f.error_message(), Contains(file.string()) &&
                                    Contains("nested deeper than 16 levels") &&
                                    Contains("a safetensors header"));
  std::printf("faults: safetensors header nested 18 deep -> refused: %s\n",
              f.error_message().c_str());
}
