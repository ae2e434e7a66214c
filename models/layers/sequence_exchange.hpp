// sequence_exchange: what an attention layer needs to run over a sequence split across ranks
// (context parallelism, Ulysses: Jacobs et al. 2023, DeepSpeed-Ulysses).
//
// Each of cp ranks holds T/cp consecutive positions of every sample through the whole block; around
// the attention core an all-to-all turns this rank's positions of every head into every position of
// this rank's heads, and back:
//
//   to_heads     [B, T/cp, H, D]  ->  [B, T, H/cp, D]    (rank r gets heads r H/cp .. of each
//   section) to_sequence  [B, T, H/cp, D]  ->  [B, T/cp, H, D]    (its inverse, and its transpose:
//   backward)
//
// The heads come in sections (a fused q | k | v projection: {Hq, Hkv, Hkv}), each split over the
// ranks on its own, so rank r's part is its q heads, then its k heads, then its v heads. The
// implementation over a communicator is models/parallel/context_parallel.hpp; this interface keeps
// the layers free of rank logic (attention.hpp only calls it).
#pragma once

#include <cstdint>
#include <span>

#include "tensor/tensor.hpp"

namespace troupe::models {

class sequence_exchange {
 public:
  virtual ~sequence_exchange() = default;

  virtual int degree() const = 0;  // cp
  // x, y contiguous and distinct, of the shapes above; sum(sections) == H, each divisible by cp.
  // Collective over the cp ranks: each calls it in the same order.
  virtual void to_heads(const tensor& x, const tensor& y,
                        std::span<const std::int64_t> sections) = 0;
  virtual void to_sequence(const tensor& x, const tensor& y,
                           std::span<const std::int64_t> sections) = 0;

  // Memory beyond the layer's planned slots (contiguous, at least `s`'s elements, viewed as s):
  enum class buffer {
    staging,    // within one forward or backward call: the projections' output, [B, T/cp, H, D]
    att_heads,  // the attention output in head layout [B, T, Hq/cp, D]: kept from this layer's
                // forward to its backward (one per layer)
    rope_cos,   // [T, D/2] RoPE tables of the whole sequence (within one call)
    rope_sin,
    // GQA with fewer kv heads than ranks (Hkv < cp, cp % Hkv == 0): each kv head is repeated
    // cp / Hkv times so that every rank receives the one its q heads read.
    kv_repeat,  // within one call: [2, B, T/cp, cp, D] the repeated k and v (backward: their
                // gradients, summed back onto the Hkv heads)
    kv_heads,   // [2, B, T, 1, D] this rank's k and v head: kept from this layer's forward to
                // its backward (one per layer)
    dkv_heads,  // within one call: [2, B, T, 1, D] their gradients
  };
  virtual tensor get(buffer which, const shape& s, dtype t) = 0;
};

}  // namespace troupe::models
