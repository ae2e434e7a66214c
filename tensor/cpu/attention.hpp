// What the CPU attention kernels (tensor/cpu/attention.cpp) hold in memory, for tests and
// benchmarks.
//
// The kernels never allocate per call: each thread keeps one scratch buffer of
// attention_scratch_bytes_per_thread(D) bytes, made through memory::buffer::host (so it counts in
// the host tier ledger), grown when a larger head dimension arrives and reused otherwise. The size
// depends on the head dimension and the tile sizes only, never on the sequence lengths T and S.
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/dtype.hpp"

namespace troupe::cpu {

// Bytes of scratch the attention kernels hold now, summed over all threads.
std::size_t attention_scratch_bytes();

// Bytes one thread needs for head dimension d (forward or backward, whichever is larger).
std::size_t attention_scratch_bytes_per_thread(std::int64_t d, dtype t);

}  // namespace troupe::cpu
