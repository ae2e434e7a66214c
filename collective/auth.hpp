// Job-membership proofs for the data plane: HMAC-SHA256 keyed by the job token (libcrypto), fresh
// nonces (getrandom) and a constant-time compare. No CAF, no UCX: the UCX transport uses it to
// authenticate every endpoint before the first tensor (collective/ucx/README.md, "Authentication").
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::collective::auth {

using digest = std::array<std::uint8_t, 32>;
using nonce = std::array<std::uint8_t, 16>;

// HMAC-SHA256(key, message). Throws troupe::error if libcrypto fails.
digest hmac(std::string_view key, std::span<const std::uint8_t> message);
// 16 random bytes from the kernel (getrandom). Throws troupe::error if none can be had.
nonce fresh_nonce();
// Equal in time independent of where the digests differ.
bool equal(const digest& a, const digest& b);

// Builds a message field by field, each length-prefixed so that no two field lists collide.
class transcript {
 public:
  transcript& add(std::span<const std::uint8_t> bytes);
  transcript& add(std::string_view s);
  transcript& add(std::int64_t v);
  const std::vector<std::uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<std::uint8_t> bytes_;
};

}  // namespace troupe::collective::auth
