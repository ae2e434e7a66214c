// sequence_ring: what an attention layer needs to run its core over a sequence split across ranks
// by ring attention (context parallelism, parallel.cp_mode = "ring";
// models/layers/ring_attention.hpp).
//
// Each of the cp ranks holds its pieces of every sample (sequence_split.hpp's layout: zigzag in
// training) through the whole block, heads included: the projections, RoPE (at the pieces' global
// positions) and o_proj run on the local tokens as without context parallelism, and only the
// attention core sees the other ranks, passing key/value blocks around the ring. The
// implementation over a communicator is models/parallel/ring_context.hpp; this interface keeps the
// layers free of rank logic (attention.cpp only calls it).
#pragma once

#include <cstdint>
#include <vector>

#include "models/layers/sequence_split.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

class sequence_ring {
 public:
  virtual ~sequence_ring() = default;

  virtual int degree() const = 0;  // cp
  // The runs of global positions this rank's `local_seq` tokens of each sample are (in local
  // order), in a sequence of local_seq x cp tokens.
  virtual std::vector<sequence_piece> pieces(std::int64_t local_seq) const = 0;
  // The core: q [B, Tl, Hq, D], k, v [B, Tl, Hkv, D] (views with a contiguous last dimension and
  // contiguous heads), out [B, Tl, Hq, D] and lse [B, Hq, Tl] contiguous: this rank's rows of the
  // attention over the whole sequence. Collective over the cp ranks: each calls it in the same
  // order. backward overwrites dq, dk, dv (like q, k, v) with this rank's rows of the gradients.
  virtual void forward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                       const tensor& lse, bool causal) = 0;
  virtual void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& lse, const tensor& dout, const tensor& dq, const tensor& dk,
                        const tensor& dv, bool causal) = 0;
};

}  // namespace troupe::models
