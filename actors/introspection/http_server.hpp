// The introspection HTTP endpoint of a job: a small read-only server on one background thread
// (Boost.Asio, kept out of this header) that answers GET and HEAD with the dashboard ("/", a static
// page that polls /json: dashboard.hpp) and the job's snapshot as an HTML table ("/table"), JSON
// ("/json") and Prometheus text ("/metrics"), and a liveness check ("/healthz").
//
// The provider is called once per request on the server thread; if it throws, the answer is a 500
// carrying the message. Nothing here changes job state. Binds to loopback unless told otherwise.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "actors/introspection/snapshot.hpp"

namespace troupe::actors {

// Bounds that keep one bad client from hurting the server.
struct http_server_limits {
  std::size_t max_header_bytes = 8192;      // a longer request head is refused with 431
  std::chrono::milliseconds timeout{5000};  // a connection lives at most this long
  int max_connections = 64;                 // more concurrent clients are closed at once
};

class http_server {
 public:
  // Binds `bind`:`port` (port 0: any free port) and starts serving; throws troupe::error naming
  // the address when it cannot bind.
  http_server(std::function<job_snapshot()> provider, std::string bind = "127.0.0.1",
              std::uint16_t port = 0);
  http_server(std::function<job_snapshot()> provider, std::string bind, std::uint16_t port,
              http_server_limits limits);
  ~http_server();  // stops and joins the server thread
  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;

  std::uint16_t port() const;             // the bound port
  std::string endpoint() const;           // "host:port" of the bound socket, e.g. "127.0.0.1:41234"
  std::uint64_t requests_served() const;  // responses written so far (all status codes)

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::actors
