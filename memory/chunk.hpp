// chunk: packing of byte ranges (a model's tensors) into fixed-size chunks, Colossal-AI Gemini
// style, and the choice of the chunk size.
//
// Tensors are packed in the order given (a model's first-use order: the slot order of its
// forward), each at an aligned offset; a tensor never straddles two chunks, so a tensor that does
// not fit in the room left in a chunk opens the next one. Every chunk has the full chunk size
// (the last one too), so the bytes wasted are chunks * chunk_bytes - the tensors' bytes
// (alignment padding and the unused tails). choose_chunk_size() tries candidate sizes and keeps
// the one that wastes the fewest bytes (ties: the smaller size, finer paging).
//
// Bytes only: a tensor is a size here and its place an (chunk, offset) record.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace troupe::memory {

struct chunk_record {
  std::int32_t chunk = 0;  // index of the chunk holding the tensor
  std::size_t offset = 0;  // byte offset inside the chunk (a multiple of the alignment)
  std::size_t bytes = 0;   // the tensor's size
};

struct chunk_layout {
  std::size_t chunk_bytes = 0;
  std::size_t alignment = 64;
  std::vector<chunk_record> records;  // one per tensor, in the order given
  std::int32_t chunks = 0;
  std::size_t payload_bytes = 0;                   // sum of the tensors' sizes
  std::vector<std::vector<std::int32_t>> members;  // chunk -> indices of its tensors, in order
  std::size_t total_bytes() const { return static_cast<std::size_t>(chunks) * chunk_bytes; }
  std::size_t wasted_bytes() const { return total_bytes() - payload_bytes; }
};

// Packs `sizes` in order into chunks of chunk_bytes (alignment: a power of two). Throws
// troupe::error naming the tensor index when one is larger than a chunk.
chunk_layout pack_chunks(std::span<const std::size_t> sizes, std::size_t chunk_bytes,
                         std::size_t alignment = 64);

// Powers of two from 64 KiB to 64 MiB.
std::vector<std::size_t> default_chunk_candidates();

struct chunk_size_trial {
  std::size_t chunk_bytes = 0;
  bool feasible = false;  // false: some tensor is larger than a chunk
  std::size_t wasted_bytes = 0;
  std::int32_t chunks = 0;
};

struct chunk_size_choice {
  chunk_layout layout;                   // the packing at the chosen size
  std::vector<chunk_size_trial> trials;  // every candidate, in the order given
};

// The candidate that wastes the fewest bytes (ties: the smaller). Throws when no candidate can
// hold the largest tensor, naming its size.
chunk_size_choice choose_chunk_size(std::span<const std::size_t> sizes,
                                    std::span<const std::size_t> candidates,
                                    std::size_t alignment = 64);

}  // namespace troupe::memory
