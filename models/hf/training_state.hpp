// training_state: what a run needs beside the weights to resume exactly.
//
// Two files in the checkpoint folder: `optimizer.safetensors` holds the AdamW moments m and v as
// flat tensors (in their own dtype, so a resumed run continues bit for bit), and
// `trainer_state.json` the step counts, the moments' shapes and a JSON object of the caller's own
// (RNG state, data position, loss scale, ...):
//
//   {"format": "troupe-trainer-state", "format_version": 1, "step": 1200, "optimizer_steps": 1198,
//    "m": {"dtype": "F32", "shape": [124475904]}, "v": {...}, "extra": {"seed": 1}}
//
// Both files are written atomically, optimizer.safetensors first; its metadata repeats the step,
// so loading detects a pair torn by a crash between the two renames. Loading checks the moments
// against the model's (the tensors m and v passed in) and reports the file at fault.
//
// A parallel plan's ranks each read only their parts of the moments: training_state_file opens
// and checks the pair the same way and hands out the moments as read-only views of the mapped file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "memory/error.hpp"
#include "models/hf/safetensors.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::hf {

// The trainer state's file in a checkpoint folder and the format it declares (checkpoint_folder
// recognises troupe's older checkpoints by them).
inline constexpr const char* trainer_state_file_name = "trainer_state.json";
inline constexpr const char* trainer_state_format = "troupe-trainer-state";

struct training_state {
  std::int64_t step = 0;             // training steps completed
  std::int64_t optimizer_steps = 0;  // AdamW updates applied (bias correction; may lag `step`
                                     // when f16 loss scaling skipped steps)
  std::string extra_json = "{}";     // a JSON object of the caller's own
};

// Writes optimizer.safetensors (m, v: any device) and trainer_state.json into `folder` (which must
// exist). Returns the files written.
expected<std::vector<std::filesystem::path>> save_training_state(
    const std::filesystem::path& folder, const training_state& state, const tensor& m,
    const tensor& v);

// save_training_state for writers that never hold the whole moments: the moments (`type`, shape
// `moments`) come through append() in parts, all of m, then all of v; commit() writes
// trainer_state.json and commits both files as save_training_state does (same bytes). Throws
// troupe::error naming the file.
class training_state_writer {
 public:
  training_state_writer(const std::filesystem::path& folder, const training_state& state,
                        dtype type, const shape& moments);
  void append(const tensor& part);  // contiguous host, of `type`
  std::vector<std::filesystem::path> commit();

 private:
  std::filesystem::path folder_;
  training_state state_;
  dtype type_;
  shape moments_;
  std::optional<safetensors_writer> file_;
};

// Reads both files of `folder`, checks them against each other and against m and v (the shapes of
// the model's moments), fills m and v, and returns the state.
expected<training_state> load_training_state(const std::filesystem::path& folder, const tensor& m,
                                             const tensor& v);

// The pair of `folder`, opened and checked as load_training_state checks it, against moments of
// shape `moments`. Move-only; m() and v() are valid while it lives.
class training_state_file {
 public:
  // A folder without optimizer.safetensors or trainer_state.json (weights only) fails naming it.
  static expected<training_state_file> open(const std::filesystem::path& folder,
                                            const shape& moments);

  const training_state& state() const { return state_; }
  const safetensors_entry& m() const { return *m_; }
  const safetensors_entry& v() const { return *v_; }
  // A moment as a read-only host tensor over the mapped bytes (never write through it); fails
  // naming the file and tensor unless it is stored as F32.
  tensor f32_view(const safetensors_entry& moment) const;

 private:
  training_state_file(training_state s, safetensors_file f);
  training_state state_;
  safetensors_file file_;
  const safetensors_entry* m_ = nullptr;
  const safetensors_entry* v_ = nullptr;
};

}  // namespace troupe::models::hf
