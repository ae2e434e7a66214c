// crc32c: CRC-32C (Castagnoli), the checksum nvme_store keeps per 4 KiB block. Uses the SSE4.2
// crc32 instruction when the CPU has it (four blocks interleaved so the instruction's latency is
// hidden), a table otherwise. Standard parameters: crc32c("123456789") == 0xE3069283.
#pragma once

#include <cstddef>
#include <cstdint>

namespace troupe::memory::io {

std::uint32_t crc32c(const void* p, std::size_t n);

// out[i] = crc32c of the i-th `block`-byte block of p (n_blocks blocks; block a multiple of 8).
void crc32c_blocks(const void* p, std::size_t block, std::size_t n_blocks, std::uint32_t* out);

bool crc32c_hardware();  // whether the SSE4.2 path is in use

}  // namespace troupe::memory::io
