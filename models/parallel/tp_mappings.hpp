// Tensor-parallel mappings: the conjugate collectives that enter and leave a tensor-parallel region
// (Megatron-LM's mappings.py), and the functions that slice full weights into a shard's part.
//
//   copy_to_region            forward identity            backward allreduce
//   reduce_from_region        forward allreduce           backward identity
//   gather_from_sequence      forward all_gather (seq)    backward reduce_scatter (seq)
//   reduce_scatter_to_seq     forward reduce_scatter      backward all_gather (seq)
//
// A region is entered with copy_to_region (or, with sequence parallelism, gather_from_sequence)
// and left with reduce_from_region (or reduce_scatter_to_sequence). Sequence-parallel activations
// are [B, T / tp, ...]: shard r holds positions r*T/tp .. (r+1)*T/tp - 1 of every sequence (the
// sequence dimension is 1, so for B > 1 the collectives go through a [tp, B, T/tp, ...] buffer).
// Every function blocks until its collective is done. The communicator's ranks must call the same
// functions in the same order (see collective/communicator.hpp).
#pragma once

#include <cstdint>
#include <string_view>

#include "collective/communicator.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

// The tensor-parallel group a layer belongs to.
struct tp_group {
  collective::communicator* comm = nullptr;  // not owned; nullptr means tp = 1
  bool sequence_parallel = false;
  int rank() const { return comm == nullptr ? 0 : comm->rank(); }
  int size() const { return comm == nullptr ? 1 : comm->size(); }
};

// n / tp, failing with a message naming `what` (e.g. "attention 'h.0.attn': n_head") when tp does
// not divide n.
std::int64_t divide_by_tp(std::int64_t n, int tp, std::string_view what);

// In-place sum over the group (x contiguous).
void allreduce_sum(const tp_group& g, const tensor& x);
// x_local [B, T/tp, ...] -> out [B, T, ...]; scratch: at least out.numel() elements (unused when
// B == 1).
void gather_sequence(const tp_group& g, const tensor& x_local, const tensor& out,
                     const tensor& scratch);
// x [B, T, ...] -> out [B, T/tp, ...], summed over the group; scratch as for gather_sequence.
void reduce_scatter_sequence(const tp_group& g, const tensor& x, const tensor& out,
                             const tensor& scratch);
// x_local [N, c] -> out [N, tp*c] (the shards side by side); scratch: at least out.numel().
void gather_last_dim(const tp_group& g, const tensor& x_local, const tensor& out,
                     const tensor& scratch);

// ---- slicing full (HF-layout, [out, in]) weights into a shard's part -------------------------

// dst = full.narrow(dim, rank * n, n) with n = full.size(dim) / tp.
void copy_shard(const tensor& full, int dim, int rank, int tp, const tensor& dst);
// A fused qkv weight [(Hq + 2 Hkv) D, ...] or bias: the shard's q heads, then its k heads, then
// its v heads, into dst [(Hq + 2 Hkv) D / tp, ...].
void copy_qkv_shard(const tensor& full, std::int64_t hq, std::int64_t hkv, std::int64_t d, int rank,
                    int tp, const tensor& dst);

}  // namespace troupe::models
