// rope_scaling: the checks and the rope_tables options of HF's rope types (rope_scaling.hpp).
#include "models/layers/rope_scaling.hpp"

#include <cmath>

#include "memory/error.hpp"

namespace troupe::models {

std::string_view rope_type_name(rope_scaling::kind k) {
  switch (k) {
    case rope_scaling::kind::linear:
      return "linear";
    case rope_scaling::kind::dynamic:
      return "dynamic";
    case rope_scaling::kind::llama3:
      return "llama3";
    default:
      return "default";
  }
}

void check_rope_scaling(const rope_scaling& s, std::int64_t head_dim, std::string_view who) {
  using kind = rope_scaling::kind;
  if (s.type == kind::none) return;
  const std::string_view type = rope_type_name(s.type);
  TROUPE_CHECK(s.factor > 0, who, ": rope_scaling ", type, ": factor must be > 0, got ", s.factor);
  if (s.type == kind::linear) return;
  TROUPE_CHECK(s.original_max_position > 0, who, ": rope_scaling ", type,
               ": the original maximum position must be > 0, got ", s.original_max_position);
  if (s.type == kind::dynamic) {
    TROUPE_CHECK(head_dim > 2, who, ": rope_scaling dynamic needs head_dim > 2 (its exponent is ",
                 "head_dim / (head_dim - 2)), got ", head_dim);
    return;
  }
  TROUPE_CHECK(s.low_freq_factor > 0 && s.high_freq_factor > s.low_freq_factor, who,
               ": rope_scaling llama3 needs 0 < low_freq_factor < high_freq_factor, got ",
               s.low_freq_factor, " and ", s.high_freq_factor);
}

ops::rope_options rope_options_for(double theta, const rope_scaling& s, std::int64_t head_dim,
                                   std::int64_t length) {
  using kind = rope_scaling::kind;
  using scaling = ops::rope_options::scaling;
  ops::rope_options o{.theta = theta};
  switch (s.type) {
    case kind::linear:
      o.type = scaling::linear;
      o.factor = s.factor;
      break;
    case kind::llama3:
      o.type = scaling::llama3;
      o.factor = s.factor;
      o.low_freq_factor = s.low_freq_factor;
      o.high_freq_factor = s.high_freq_factor;
      o.original_max_position = static_cast<double>(s.original_max_position);
      break;
    case kind::dynamic:
      if (length > s.original_max_position) {
        const double d = static_cast<double>(head_dim);
        // HF's order of operations: factor * n / max - (factor - 1).
        const double grown =
            s.factor * static_cast<double>(length) / static_cast<double>(s.original_max_position) -
            (s.factor - 1);
        o.theta = theta * std::pow(grown, d / (d - 2));
      }
      break;
    default:
      break;
  }
  return o;
}

}  // namespace troupe::models
