// checkpoint_folder: which folders a checkpoint save may replace, so that no save ever deletes a
// user's files.
//
// A save replaces its folder as one unit (file_io.hpp: stage_folder, publish_folder), which removes
// whatever the folder held before. So a folder is replaced only when it is absent, empty, or a
// troupe checkpoint holding nothing but the files troupe writes into one. A troupe checkpoint is
// recognised by its marker, `troupe_checkpoint.json` ({"format": "troupe-checkpoint", ...}), which
// stage_folder writes first into every new checkpoint (so a save cut off half way is recognised
// too), or, for checkpoints written before the marker, by a `trainer_state.json` whose format is
// "troupe-trainer-state". An HF folder the user downloaded (config.json, model.safetensors,
// tokenizer files) has neither and is never replaced. The same rule guards the sibling folders a
// save uses, `<folder>.partial` and `<folder>.old`.
//
// A refusal names the folder and (some of) what it holds, so the user can move them or pick
// another folder; check_checkpoint_dir gives it when the run is configured, before any training.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "memory/error.hpp"

namespace troupe::models::hf {

inline constexpr const char* checkpoint_marker_file = "troupe_checkpoint.json";

// Whether troupe writes a file of this name into a checkpoint folder (weights, shards and their
// index, config.json, the optimizer state, the marker, troupe_parallel.json, any of these with
// ".tmp" while a write is under way).
bool is_checkpoint_file_name(std::string_view name);

// What a folder holds, as far as replacing it goes.
struct folder_survey {
  bool exists = false;
  std::string not_a_folder;  // "a file", "a symbolic link", ...: never replaced ("" for a folder)
  std::size_t entries = 0;
  bool marked = false;               // a troupe checkpoint (the marker, or trainer_state.json)
  std::vector<std::string> foreign;  // entries troupe never writes into a checkpoint (sorted)
  std::optional<std::int64_t> step;  // the step its trainer_state.json records
  bool replaceable() const;          // absent, empty, or marked with nothing foreign
  std::string describe() const;      // "empty", "the troupe checkpoint of step 20", ...
};
// Never throws: what cannot be read is reported as foreign.
folder_survey survey_folder(const std::filesystem::path& folder);

// Throws troupe::error unless a save may replace `folder` (its `role` in the message: "checkpoint
// folder", "the staging folder", ...). The message names the folder and up to 5 of its files.
void check_replaceable(const std::filesystem::path& folder, std::string_view role);

// The check a run makes when it is configured (before the first step): `folder` and its siblings
// `<folder>.partial` and `<folder>.old` must all be replaceable. Returns a line for the log saying
// what `folder` holds now ("'ck' holds the troupe checkpoint of step 20: the next save replaces
// it"), or the refusal.
expected<std::string> check_checkpoint_dir(const std::filesystem::path& folder);

// The step that the checkpoint in `folder` holds (its trainer_state.json), if it is one.
std::optional<std::int64_t> checkpoint_step(const std::filesystem::path& folder);

// The log line of a save: "checkpoint: step 20 saved in 'ck' (it held step 10 before)".
std::string saved_line(const std::filesystem::path& folder, std::int64_t step,
                       std::optional<std::int64_t> replaced);

// Writes the marker into `dir` (atomically; a new checkpoint's staging folder).
void write_checkpoint_marker(const std::filesystem::path& dir);

}  // namespace troupe::models::hf
