#include "collective/auth.hpp"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "memory/error.hpp"

namespace troupe::collective::auth {

digest hmac(std::string_view key, std::span<const std::uint8_t> message) {
  digest out{};
  unsigned int len = 0;
  const unsigned char* r = HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()),
                                message.data(), message.size(), out.data(), &len);
  TROUPE_CHECK(r != nullptr && len == out.size(), "HMAC-SHA256 failed (libcrypto)");
  return out;
}

nonce fresh_nonce() {
  nonce n{};
  std::size_t got = 0;
  while (got < n.size()) {
    ssize_t k = getrandom(n.data() + got, n.size() - got, 0);
    if (k < 0 && errno == EINTR) continue;
    TROUPE_CHECK(k > 0, "getrandom failed: ", std::strerror(errno));
    got += static_cast<std::size_t>(k);
  }
  return n;
}

bool equal(const digest& a, const digest& b) {
  return CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

transcript& transcript::add(std::span<const std::uint8_t> b) {
  add(static_cast<std::int64_t>(b.size()));
  bytes_.insert(bytes_.end(), b.begin(), b.end());
  return *this;
}

transcript& transcript::add(std::string_view s) {
  return add(
      std::span<const std::uint8_t>(reinterpret_cast<const std::uint8_t*>(s.data()), s.size()));
}

transcript& transcript::add(std::int64_t v) {
  for (int i = 0; i < 8; ++i)
    bytes_.push_back(static_cast<std::uint8_t>(static_cast<std::uint64_t>(v) >> (8 * i)));
  return *this;
}

}  // namespace troupe::collective::auth
