// targets: next-token targets with the last position ignored (targets.hpp).
#include "models/targets.hpp"

#include "memory/error.hpp"

namespace troupe::models {

void next_token_targets(const tensor& ids, const tensor& targets, std::int32_t ignore_index) {
  TROUPE_CHECK(ids.defined() && ids.dim() == 2 && ids.type() == dtype::i32 && ids.is_cpu() &&
                   ids.is_contiguous(),
               "next_token_targets: ids must be contiguous host i32 [B, T], got ",
               ids.defined() ? ids.describe() : "undefined");
  TROUPE_CHECK(targets.defined() && targets.sizes() == ids.sizes() &&
                   targets.type() == dtype::i32 && targets.is_cpu() && targets.is_contiguous(),
               "next_token_targets: targets must be contiguous host i32 ", ids.sizes().str(),
               " like ids, got ", targets.defined() ? targets.describe() : "undefined");
  TROUPE_CHECK(targets.data() != ids.data(), "next_token_targets: targets may not alias ids");
  const std::int32_t* in = ids.data_as<std::int32_t>();
  std::int32_t* out = targets.data_as<std::int32_t>();
  std::int64_t b = ids.size(0), t = ids.size(1);
  for (std::int64_t r = 0; r < b; ++r) {
    for (std::int64_t i = 0; i + 1 < t; ++i) out[r * t + i] = in[r * t + i + 1];
    if (t > 0) out[r * t + t - 1] = ignore_index;
  }
}

batch_dims checked_batch(const tensor& ids, const tensor& targets, batch_dims planned,
                         std::string_view who) {
  TROUPE_CHECK(ids.defined() && ids.dim() == 2 && ids.type() == dtype::i32, who,
               ": ids must be i32 [B, T], got ", describe(ids));
  TROUPE_CHECK(targets.defined() && targets.sizes() == ids.sizes(), who, ": targets ",
               describe(targets), " must have the shape of ids ", ids.describe());
  const batch_dims b{ids.size(0), ids.size(1)};
  TROUPE_CHECK(b.batch <= planned.batch && b.seq <= planned.seq, who, ": batch [", b.batch, ", ",
               b.seq, "] exceeds the planned [", planned.batch, ", ", planned.seq, "]");
  return b;
}

}  // namespace troupe::models
