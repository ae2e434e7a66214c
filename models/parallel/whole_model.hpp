// whole_model: the whole model of an HF config as a description, never as memory - an unbound gpt
// or llama (gpt_config::unbound): its parameters' names and shapes (slots()), their places in the
// single-process model's flat layout (layout(), reshard.hpp's whole_layout), and its initial
// values drawn parameter after parameter (init_values). A rank of a parallel plan uses it to fill
// its piece (a tensor shard, a pipeline stage, a shard of a stage) one whole parameter at a time,
// so it holds its piece plus one parameter's scratch, never the whole model:
//
//   whole_model whole(cfg);
//   init_piece(whole, seed, piece, piece.base);            // = the single-process init_weights
//   load_piece(whole, "ckpt/", piece, piece.base);          // = hf::load_weights, sliced
//
// Both give the piece exactly the values the single-process model's init_weights(seed) or
// hf::load_weights give its parameters (bit for bit: the same draws, the same f64 -> f32 rounding,
// then a plain copy of the slice). Peak scratch: one parameter, f64 while it is drawn.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>

#include "models/hf/config.hpp"
#include "models/layers/slots.hpp"
#include "models/parallel/reshard.hpp"

namespace troupe::models::parallel {

class whole_model {
 public:
  explicit whole_model(const hf::model_config& model);
  ~whole_model();
  whole_model(const whole_model&) = delete;
  whole_model& operator=(const whole_model&) = delete;

  const hf::model_config& config() const { return config_; }
  // The parameters' names and shapes (no memory bound).
  const slot_list& slots() const { return *slots_; }
  const whole_layout& layout() const { return layout_; }
  // The single-process model's init_weights(seed), parameter after parameter (declaration order).
  void init_values(std::uint64_t seed, const init_sink& each) const;

 private:
  hf::model_config config_;
  std::shared_ptr<const void> model_;  // the family's unbound whole model (models/families.hpp)
  const slot_list* slots_ = nullptr;
  std::function<void(std::uint64_t, const init_sink&)> init_;
  whole_layout layout_;
};

// The piece's parameters (into `to`, laid out like piece.base) as the single-process model's
// init_weights(seed) sets them.
void init_piece(const whole_model& whole, std::uint64_t seed, const piece_layout& piece,
                const tensor& to);

// The piece's parameters (into `to`) from the HF weights of `folder` (a checkpoint of the whole
// model's config: one file or shards), read straight from the mapped files: only the tensors the
// piece holds are read, each into one parameter's scratch, then sliced. The folder is checked as
// hf::load_weights checks it before anything is written; errors name the file and the tensor
// (those of reading and slicing one tensor start with the folder and the tensor's HF name).
void load_piece(const whole_model& whole, const std::filesystem::path& folder,
                const piece_layout& piece, const tensor& to);

}  // namespace troupe::models::parallel
