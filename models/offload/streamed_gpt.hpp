// streamed_gpt: GPT-2 (the same layers, parameter names and arithmetic as models/gpt.hpp) run one
// UNIT at a time, so that a caller can bring a unit's parameters into memory right before it runs
// and take them away right after (ZeRO-Infinity parameter streaming).
//
// Units: 0 = the embeddings (wte, wpe), 1..n_layer = the blocks, n_layer + 1 = the head (ln_f and
// the tied wte). A step is forward_unit(0..U-1), then backward_unit(U-1..0). The model plans and
// owns its activations and scratch (memory::plan_memory over the slots' live intervals, as
// layer_memory does) but NOT its parameters and gradients: before a unit runs, the caller binds
// the fields of that unit's parameter slots (and, for backward, their gradient fields) to memory
// it holds, e.g. chunks of a memory::tier_manager. The gradients accumulate (+=) as in gpt.
//
// The code is gpt's own: its blocks (gpt_block) and its two ends (gpt_ends: the embeddings, the
// final norm, the tied head and the loss), so the result equals gpt's bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "memory/arena.hpp"
#include "models/gpt.hpp"
#include "models/layers/slots.hpp"

namespace troupe::models {

class streamed_gpt {
 public:
  streamed_gpt(const gpt_config& cfg, batch_dims dims);
  streamed_gpt(const streamed_gpt&) = delete;
  streamed_gpt& operator=(const streamed_gpt&) = delete;

  const gpt_config& config() const { return cfg_; }
  // Every slot; the parameter slots' fields (value and grad) are bound by the caller.
  const slot_list& slots() const { return slots_; }
  std::int32_t units() const { return static_cast<std::int32_t>(unit_params_.size()); }
  // Indices into slots().slots() of the parameters unit u reads, in slot order.
  const std::vector<std::int32_t>& unit_params(std::int32_t u) const;
  // Bytes of the planned activations and scratch: the model's non-model memory.
  std::size_t non_model_bytes() const { return activations_.capacity() + scratch_.capacity(); }

  // ids, targets: i32 [B, T]; they must stay intact until the step's backward is done.
  void begin(const tensor& ids, const tensor& targets);
  void forward_unit(std::int32_t u);
  double loss() const { return loss_value_; }  // after the head's forward
  void backward_unit(std::int32_t u, double loss_scale = 1.0);

 private:
  gpt_config cfg_;
  batch_dims dims_;
  gpt_ends ends_;  // gpt's embeddings and head
  std::vector<gpt_block> h_;
  owned_tensor pos_ids_;
  std::vector<tensor> x_;
  tensor ids_, targets_, da_, db_;
  std::int64_t b_ = 0, t_ = 0;
  double loss_value_ = 0;
  slot_list slots_;
  memory::arena activations_, scratch_;
  std::vector<std::vector<std::int32_t>> unit_params_;
};

}  // namespace troupe::models
