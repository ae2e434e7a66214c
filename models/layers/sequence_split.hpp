// How a sequence is split over the cp ranks of a context-parallel group, and the helpers that cut
// a full tensor into a rank's part and put the parts back.
//
// contiguous: rank r holds tokens [r T/cp, (r+1) T/cp). Under a causal mask rank r's queries see
//   r + 1 of the cp key blocks, so the last rank works cp times as much as the first.
// zigzag: the sequence is cut into 2 cp chunks of T/(2 cp) tokens and rank r holds chunks r and
//   2 cp - 1 - r, in that order (the load balance of the zigzag ring attention and of Megatron's
//   context parallel): every rank then computes the same number of causal query-key tiles.
//
// The split is along dimension 1 of [B, T, ...] tensors (token ids [B, T], positions, activations
// [B, T, C], q/k/v [B, T, H, D]); any dtype ops::copy copies, on any device. T must divide by cp
// (contiguous) or by 2 cp (zigzag).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::models {

enum class sequence_layout : std::uint8_t { contiguous, zigzag };

const char* sequence_layout_name(sequence_layout l);

// One run of consecutive tokens a rank holds: global tokens [start, start + length), stored in the
// rank's part from local token `local`.
struct sequence_piece {
  std::int64_t start = 0;
  std::int64_t length = 0;
  std::int64_t local = 0;
};

// The pieces rank `rank` of `cp` holds of a sequence of `t` tokens, in local order (one piece when
// contiguous, two when zigzag). Throws troupe::error naming t and cp when t does not split.
std::vector<sequence_piece> sequence_pieces(std::int64_t t, int cp, int rank, sequence_layout l);

// The global position of each of the rank's t / cp local tokens (for RoPE and for position ids).
std::vector<std::int64_t> local_positions(std::int64_t t, int cp, int rank, sequence_layout l);

// local = rank's part of full, along dimension 1: full [B, T, ...], local [B, T / cp, ...].
void split_sequence(const tensor& full, int cp, int rank, sequence_layout l, const tensor& local);
// The inverse: writes the rank's part `local` into its places in `full`. Called for every rank,
// it rebuilds full from the parts.
void unsplit_sequence(const tensor& local, int cp, int rank, sequence_layout l, const tensor& full);

}  // namespace troupe::models
