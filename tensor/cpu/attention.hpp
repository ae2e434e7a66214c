// What the CPU attention kernels (tensor/cpu/attention.cpp) hold in memory, for tests and
// benchmarks.
//
// The kernels never allocate per call: each thread keeps one scratch buffer of
// attention_scratch_bytes_per_thread(D) bytes, made through memory::buffer::host (so it counts in
// the host tier ledger), grown when a larger head dimension arrives and reused otherwise. For f32
// and f64 the size depends on the head dimension and the tile sizes only, never on the sequence
// lengths T and S; the backward of bf16 and f16 adds f32 rows for one head's dk and dv (S D each).
#pragma once

#include <cstddef>
#include <cstdint>

#include "tensor/dtype.hpp"

namespace troupe::cpu {

// Bytes of scratch the attention kernels hold now, summed over all threads.
std::size_t attention_scratch_bytes();

// Bytes one thread needs for head dimension d (forward or backward, whichever is larger). For bf16
// and f16 the tiles are f32, and backward also holds dk and dv of one head in f32: 2 s d floats
// more for s keys (the one size that grows with the sequence).
std::size_t attention_scratch_bytes_per_thread(std::int64_t d, dtype t, std::int64_t s = 0);

}  // namespace troupe::cpu
