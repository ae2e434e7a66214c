// TLS for the control plane: CAF's openssl module carries the messages between the ranks and the
// coordinator when a job asks for it (`troupe launch --tls --tls-cert C --tls-key K [--tls-ca A]`,
// or TROUPE_TLS_CERT / TROUPE_TLS_KEY / TROUPE_TLS_CA in a rank's environment). Every process
// presents the certificate and checks its peer's against the CA (default: the certificate itself,
// so a self-signed certificate is its own CA); host names are not checked. Tensor bytes over UCX
// are authenticated by the job token (collective/ucx/README.md), not encrypted. No CAF type here.
#pragma once

#include <string>

namespace troupe::actors {

struct tls_options {
  std::string cert;  // PEM certificate (chain) this process presents
  std::string key;   // its PEM private key, unencrypted
  std::string ca;    // PEM CA certificates peers must chain to (empty: `cert`)
  bool enabled() const { return !cert.empty() || !key.empty() || !ca.empty(); }
  const std::string& ca_file() const { return ca.empty() ? cert : ca; }
};

// Whether this build has CAF's openssl module (libcaf-openssl).
bool tls_supported();

// How the settings were given, for the messages: command-line flags or environment variables.
enum class tls_source { flags, environment };

// Checks the settings before anything listens or connects: TLS built in, certificate and key
// given, every file readable PEM, the key unencrypted and matching the certificate, and the
// certificate chaining to the CA. Throws troupe::error naming the flag (or variable) and the file.
void check_tls(const tls_options& tls, tls_source source);

// The settings with every path made absolute (ranks may run elsewhere in the file system).
tls_options absolute_tls_paths(tls_options tls);

}  // namespace troupe::actors
