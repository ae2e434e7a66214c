// Chunk packing and the chunk size search (see chunk.hpp).
#include "memory/chunk.hpp"

#include <algorithm>

#include "memory/error.hpp"

namespace troupe::memory {

chunk_layout pack_chunks(std::span<const std::size_t> sizes, std::size_t chunk_bytes,
                         std::size_t alignment) {
  TROUPE_CHECK(alignment > 0 && (alignment & (alignment - 1)) == 0,
               "pack_chunks: alignment must be a power of two, got ", alignment);
  TROUPE_CHECK(chunk_bytes > 0 && chunk_bytes % alignment == 0, "pack_chunks: chunk_bytes (",
               chunk_bytes, ") must be a positive multiple of the alignment (", alignment, ")");
  chunk_layout l;
  l.chunk_bytes = chunk_bytes;
  l.alignment = alignment;
  l.records.reserve(sizes.size());
  std::size_t used = chunk_bytes;  // no chunk open yet
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    const std::size_t n = sizes[i];
    TROUPE_CHECK(n <= chunk_bytes, "pack_chunks: tensor ", i, " has ", n,
                 " bytes, more than a chunk (", chunk_bytes, ")");
    std::size_t at = (used + alignment - 1) / alignment * alignment;
    if (l.chunks == 0 || at + n > chunk_bytes) {  // open the next chunk
      ++l.chunks;
      l.members.emplace_back();
      at = 0;
    }
    l.records.push_back({l.chunks - 1, at, n});
    l.members.back().push_back(static_cast<std::int32_t>(i));
    used = at + n;
    l.payload_bytes += n;
  }
  return l;
}

std::vector<std::size_t> default_chunk_candidates() {
  std::vector<std::size_t> c;
  for (std::size_t s = std::size_t{64} << 10; s <= std::size_t{64} << 20; s *= 2) c.push_back(s);
  return c;
}

chunk_size_choice choose_chunk_size(std::span<const std::size_t> sizes,
                                    std::span<const std::size_t> candidates,
                                    std::size_t alignment) {
  TROUPE_CHECK(!candidates.empty(), "choose_chunk_size: no candidate sizes");
  const std::size_t largest = sizes.empty() ? 0 : *std::max_element(sizes.begin(), sizes.end());
  chunk_size_choice out;
  bool have = false;
  for (std::size_t c : candidates) {
    chunk_size_trial t{.chunk_bytes = c};
    if (c >= largest && c % alignment == 0) {
      chunk_layout l = pack_chunks(sizes, c, alignment);
      t.feasible = true;
      t.wasted_bytes = l.wasted_bytes();
      t.chunks = l.chunks;
      const bool better =
          !have || t.wasted_bytes < out.layout.wasted_bytes() ||
          (t.wasted_bytes == out.layout.wasted_bytes() && c < out.layout.chunk_bytes);
      if (better) {
        out.layout = std::move(l);
        have = true;
      }
    }
    out.trials.push_back(t);
  }
  TROUPE_CHECK(have, "choose_chunk_size: no candidate holds the largest tensor (", largest,
               " bytes); the largest candidate is ",
               *std::max_element(candidates.begin(), candidates.end()));
  return out;
}

}  // namespace troupe::memory
