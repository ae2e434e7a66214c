// bounded_json: every JSON file troupe reads goes through here, with a stated bound on its size
// and on how deeply its arrays and objects nest, so that a hostile or broken file is refused with
// its name and the bound instead of filling the memory or the stack (a recursive dump or
// destructor of a value nested a million levels deep).
//
//   kind                          bytes    depth
//   config.json                   4 MiB     32
//   model.safetensors.index.json  64 MiB    16
//   trainer_state.json            16 MiB    32
//   troupe_checkpoint.json        64 KiB     8
//   a safetensors header          100 MB    16   (the size bound is the format's, safetensors.cpp)
//   a GPT-2 tokenizer vocab.json  256 MiB    8
//   a job registry entry          64 KiB     8   (actors/introspection/job_registry.cpp)
//
// The size is checked before the file is read (a file over it is never loaded); depth counts
// containers: `{}` and `[]` are depth 1, `{"a": [1]}` depth 2.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace troupe::models::hf {

struct json_bounds {
  const char* kind;  // for messages: "config.json", "a safetensors header", ...
  std::uint64_t max_bytes;
  int max_depth;
};

inline constexpr json_bounds config_json_bounds{"config.json", 4ull << 20, 32};
inline constexpr json_bounds index_json_bounds{"a shard index", 64ull << 20, 16};
inline constexpr json_bounds trainer_state_bounds{"trainer_state.json", 16ull << 20, 32};
inline constexpr json_bounds checkpoint_marker_bounds{"troupe_checkpoint.json", 64ull << 10, 8};
inline constexpr json_bounds safetensors_header_bounds{"a safetensors header", 100'000'000, 16};
inline constexpr json_bounds vocab_json_bounds{"a tokenizer vocabulary", 256ull << 20, 8};
inline constexpr json_bounds registry_entry_bounds{"a job registry entry", 64ull << 10, 8};

// Throws troupe::error "<where>: nested deeper than <max_depth> levels, the bound for <kind>"
// when `depth` (of a container being opened, counted from 1) exceeds the bound.
void check_json_depth(int depth, const json_bounds& b, std::string_view where);

// The text of `path`, refused (troupe::error naming the file, its size and the bound) when it is
// larger than b.max_bytes, or when it cannot be read.
std::string read_bounded_text(const std::filesystem::path& path, const json_bounds& b);

// Parses `text` (from `where`, for messages). Throws troupe::error naming `where` when the text
// is longer than b.max_bytes, nests deeper than b.max_depth, or is not valid JSON.
template <class Json = nlohmann::json>
Json parse_bounded_json(std::string_view text, const json_bounds& b, std::string_view where);

// read_bounded_text + parse_bounded_json; messages name the file.
template <class Json = nlohmann::json>
Json read_bounded_json(const std::filesystem::path& path, const json_bounds& b);

extern template nlohmann::json parse_bounded_json<nlohmann::json>(std::string_view,
                                                                  const json_bounds&,
                                                                  std::string_view);
extern template nlohmann::ordered_json parse_bounded_json<nlohmann::ordered_json>(
    std::string_view, const json_bounds&, std::string_view);
extern template nlohmann::json read_bounded_json<nlohmann::json>(const std::filesystem::path&,
                                                                 const json_bounds&);
extern template nlohmann::ordered_json read_bounded_json<nlohmann::ordered_json>(
    const std::filesystem::path&, const json_bounds&);

}  // namespace troupe::models::hf
