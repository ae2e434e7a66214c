// rope_scaling: HF's `rope_scaling` of a Llama config as the model computes with it (transformers'
// modeling_rope_utils.py; checked against 4.44), and the ops::rope_tables options it gives for a
// sequence length.
//
//   none     HF's default: inv_i = theta^(-2i/D)
//   linear   inv_i / factor
//   llama3   Llama 3.1's bands by wavelength against original_max_position (ops.hpp)
//   dynamic  NTK: for n positions with n > original_max_position (HF's max_position_embeddings),
//            theta_n = theta * (factor * n / original_max_position - (factor - 1))^(D / (D - 2));
//            theta itself up to original_max_position.
// HF scales cos and sin by an attention_factor of 1 for all of these (it is not 1 only for yarn and
// longrope, which troupe does not implement).
//
// Which n dynamic uses. A training forward of [B, T] uses T, and a kv-cache step the positions so
// far with the new ones (models/kv_cache.cpp: start + t); HF computes from max(position_ids) + 1,
// which is the same in both cases. HF also remembers, in its rotary module, the longest n it has
// used and keeps that theta for any shorter call until a call of fewer than max_position_embeddings
// positions resets it; troupe computes from each call's own n. The two agree whenever the lengths
// of successive calls do not decrease (one training length; the steps of one generation).
#pragma once

#include <cstdint>
#include <string_view>

#include "tensor/ops.hpp"

namespace troupe::models {

struct rope_scaling {
  enum class kind { none, linear, dynamic, llama3 };
  kind type = kind::none;
  double factor = 1.0;            // linear, dynamic, llama3: > 0
  double low_freq_factor = 1.0;   // llama3: > 0
  double high_freq_factor = 4.0;  // llama3: > low_freq_factor
  // llama3: original_max_position_embeddings; dynamic: the length above which theta grows (HF
  // uses max_position_embeddings). > 0 for both.
  std::int64_t original_max_position = 0;

  bool operator==(const rope_scaling&) const = default;
};

// "none", "linear", "dynamic" or "llama3" (HF's rope_type; "default" for none).
std::string_view rope_type_name(rope_scaling::kind k);

// Throws naming `who` and the field when a value is out of range for the type (dynamic also
// needs head_dim > 2 for its exponent D / (D - 2)).
void check_rope_scaling(const rope_scaling& s, std::int64_t head_dim, std::string_view who);

// The options of ops::rope_tables for a sequence of `length` positions (see above for dynamic).
ops::rope_options rope_options_for(double theta, const rope_scaling& s, std::int64_t head_dim,
                                   std::int64_t length);

}  // namespace troupe::models
