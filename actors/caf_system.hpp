// Internal to actors/*.cpp: the CAF actor system every troupe process runs (io middleman, the
// `sharing` scheduler with few threads, troupe's message types), and small CAF helpers.
#pragma once

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/io/middleman.hpp>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "actors/messages.hpp"
#include "actors/tls.hpp"

namespace troupe::actors::detail {

// Loads CAF's openssl module with these files (caf_system.cpp; throws without the module).
void enable_tls(caf::actor_system_config& cfg, const tls_options& tls);

// The CAF configuration of a troupe process. `threads` 0: TROUPE_CAF_THREADS or 2. The default
// work-stealing scheduler roughly triples the round trip on small machines: use `sharing`.
// With `tls` enabled (checked before: check_tls) it loads CAF's openssl module with those files;
// then publish_actor / connect_actor speak TLS, and every peer must present a certificate that
// chains to the CA.
inline std::unique_ptr<caf::actor_system_config> make_caf_config(int threads,
                                                                 const tls_options* tls = nullptr) {
  if (threads <= 0) {
    threads = 2;
    if (const char* t = std::getenv("TROUPE_CAF_THREADS"); t && std::atoi(t) > 0)
      threads = std::atoi(t);
  }
  auto cfg = std::make_unique<caf::actor_system_config>();
  cfg->load<caf::io::middleman>();
  cfg->add_message_types<caf::id_block::troupe_actors>();
  cfg->set("scheduler.policy", caf::atom("sharing"));
  cfg->set("scheduler.max-threads", static_cast<std::size_t>(threads));
  cfg->set("logger.console", caf::atom("none"));
  if (tls != nullptr && tls->enabled()) enable_tls(*cfg, *tls);
  return cfg;
}

// Whether this actor system speaks TLS (its config loaded the openssl module).
bool uses_tls(caf::actor_system& sys);

// Publishes `a` at in:port (in nullptr: every address), over TLS when the system speaks it.
caf::expected<std::uint16_t> publish_actor(caf::actor_system& sys, const caf::actor& a,
                                           std::uint16_t port, const char* in);

// A handle on the actor published at host:port, over TLS when the system speaks it.
caf::expected<caf::actor> connect_actor(caf::actor_system& sys, const std::string& host,
                                        std::uint16_t port);

// The words for a failed handshake: TLS on one side only, or a certificate the other side does
// not trust, end it the same way (CAF's disconnect_during_handshake). Empty for other errors.
std::string handshake_hint(caf::actor_system& sys, const caf::error& e);

// "host:port" -> host, port (the last ':' splits; "[v6]:port" too). Empty host on failure.
inline std::pair<std::string, std::uint16_t> split_endpoint(const std::string& ep) {
  const auto colon = ep.rfind(':');
  if (colon == std::string::npos || colon + 1 >= ep.size()) return {"", 0};
  std::string host = ep.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  char* end = nullptr;
  const long port = std::strtol(ep.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port <= 0 || port > 65535) return {"", 0};
  return {host, static_cast<std::uint16_t>(port)};
}

}  // namespace troupe::actors::detail
