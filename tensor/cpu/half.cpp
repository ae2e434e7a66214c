// Per-thread f32 scratch of the 16-bit CPU kernel paths (tensor/cpu/half.hpp).
#include "tensor/cpu/half.hpp"

#include "memory/buffer.hpp"

namespace troupe::cpu {

float* thread_floats(std::size_t n) {
  thread_local memory::buffer buf;
  const std::size_t bytes = std::max<std::size_t>(n, 16) * sizeof(float);
  if (buf.size() < bytes) {
    buf = memory::buffer();
    buf = memory::buffer::host(bytes);
  }
  return static_cast<float*>(buf.data());
}

}  // namespace troupe::cpu
