// reshard: moving per-parameter state (weights, gradients, AdamW moments: anything laid out like a
// flat parameter buffer) between a whole model's layout and a piece's - a tensor-parallel shard, a
// pipeline stage, or a shard of a stage - by parameter name. Checkpoints use it to write one HF
// layout whatever the plan, and to load it under another plan. The whole side is a layout (data),
// so a piece never needs the whole model's memory: whole buffers, or one parameter at a time.
//
// A piece's parameter is matched to the whole model's parameter of the same name and copied with
// copy_slice (param_slices.hpp) as the piece's declaration of it says (param_spec): the whole of
// it when replicated (norms on every shard; any parameter of an unsharded stage), else the shard's
// part of each section along the split axis. Names the piece lacks are someone else's.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "models/layers/slots.hpp"

namespace troupe::models::parallel {

struct piece_layout {
  const slot_list* slots = nullptr;  // the piece's parameters
  tensor base;                       // the piece's flat parameter buffer (offsets are from it)
  int tp_rank = 0, tp = 1;
  // Whether this piece writes `parameter` when gathering (of the ranks holding a replicated
  // parameter exactly one should); empty: every parameter.
  std::function<bool(const tensor_slot&)> owns;
};

// The whole model's parameters as data (no memory): names, shapes and offsets in the whole flat
// layout - the single-process model's params(), padding included, which is also the layout of
// optimizer.safetensors' moments.
struct whole_param {
  std::string name;
  shape sizes;
  std::int64_t offset = 0;  // in elements of the flat layout
  std::int64_t numel() const { return sizes.numel(); }
};

struct whole_layout {
  std::vector<whole_param> params;  // in declaration order (the init's and the flat order)
  std::int64_t numel = 0;           // elements of the flat layout
  // The layout of the parameter slots of `slots` as layer_memory(slots, f32) places them (the slots
  // need no memory bound: an unbound model's).
  static whole_layout of(const slot_list& slots);
  const whole_param* find(std::string_view name) const;  // nullptr when absent
  // The parameter's view of `flat` (laid out like this layout); fails when flat is too small.
  tensor view(const tensor& flat, const whole_param& p) const;
};

// Where `field` (a view into the flat buffer `base`) starts in it, in elements; fails naming both
// when it lies outside.
std::int64_t offset_in(const tensor& field, const tensor& base);

// One whole parameter at a time (streamed init, loading and saving). scatter_param: the piece's
// slice of `full` (whole parameter `name`, its whole shape) into `to` (laid out like piece.base);
// false when the piece does not hold `name`. gather_param: the piece's part of `name` from `from`
// (laid out like piece.base) into its place in `full`; false (full untouched) when the piece does
// not hold or does not own it.
bool scatter_param(std::string_view name, const tensor& full, const piece_layout& piece,
                   const tensor& to);
bool gather_param(const piece_layout& piece, const tensor& from, std::string_view name,
                  const tensor& full);

// For every parameter of the piece: its part of `from` (laid out like whole.base) into `to` (laid
// out like piece.base). Fails naming the parameter when the whole model lacks it or no rule fits.
void scatter_to_piece(const whole_layout& whole, const tensor& from, const piece_layout& piece,
                      const tensor& to);

// For every parameter the piece owns: its part from `from` (laid out like piece.base) into its
// place in `to` (laid out like whole.base); the rest of `to` is left as it is.
void gather_from_piece(const piece_layout& piece, const tensor& from, const whole_layout& whole,
                       const tensor& to);

}  // namespace troupe::models::parallel
