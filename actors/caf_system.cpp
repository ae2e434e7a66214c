// The TLS side of the CAF helpers (caf_system.hpp): CAF's openssl module when this build has it.
#include "actors/caf_system.hpp"

#ifdef TROUPE_HAVE_CAF_OPENSSL
#include <caf/openssl/manager.hpp>
#include <caf/openssl/publish.hpp>
#include <caf/openssl/remote_actor.hpp>
#endif

#include "actors/openssl_error_queue.hpp"
#include "memory/error.hpp"

namespace troupe::actors::detail {

void enable_tls(caf::actor_system_config& cfg, const tls_options& tls) {
#ifdef TROUPE_HAVE_CAF_OPENSSL
  // CAF's openssl module leaves OpenSSL's error queue dirty (openssl_error_queue.hpp).
  TROUPE_CHECK(openssl_error_queue_guarded(), "TLS: this executable does not interpose SSL_read ",
               "(actors/openssl_error_queue.cpp): one failed handshake could close other links");
  cfg.load<caf::openssl::manager>();
  cfg.openssl_certificate = tls.cert;
  cfg.openssl_key = tls.key;
  cfg.openssl_cafile = tls.ca_file();
#else
  (void)cfg;
  (void)tls;
  TROUPE_FAIL("TLS: this troupe was built without CAF's openssl module (libcaf_openssl)");
#endif
}

bool uses_tls(caf::actor_system& sys) {
#ifdef TROUPE_HAVE_CAF_OPENSSL
  return sys.has_openssl_manager();
#else
  (void)sys;
  return false;
#endif
}

caf::expected<std::uint16_t> publish_actor(caf::actor_system& sys, const caf::actor& a,
                                           std::uint16_t port, const char* in) {
#ifdef TROUPE_HAVE_CAF_OPENSSL
  if (uses_tls(sys)) return caf::openssl::publish(a, port, in, true);
#endif
  return sys.middleman().publish(a, port, in, true);
}

caf::expected<caf::actor> connect_actor(caf::actor_system& sys, const std::string& host,
                                        std::uint16_t port) {
#ifdef TROUPE_HAVE_CAF_OPENSSL
  if (uses_tls(sys)) return caf::openssl::remote_actor(sys, host, port);
#endif
  return sys.middleman().remote_actor(host, port);
}

std::string handshake_hint(caf::actor_system& sys, const caf::error& e) {
  if (e != caf::sec::disconnect_during_handshake) return {};
  return uses_tls(sys) ? " (this process uses TLS: the other side does not, or one side does not "
                         "trust the other's certificate)"
                       : " (this process does not use TLS: the other side may; then give --tls, "
                         "or TROUPE_TLS_CERT and TROUPE_TLS_KEY, here too)";
}

}  // namespace troupe::actors::detail
