// The introspection HTTP endpoint of a job: a small read-only server on one background thread
// (Boost.Asio, kept out of this header) that answers GET and HEAD with the dashboard ("/", a static
// page that polls /json: dashboard.hpp) and the job's snapshot as an HTML table ("/table"), JSON
// ("/json") and Prometheus text ("/metrics"), and a liveness check ("/healthz"). Every other
// method gets 405, on every path: nothing here changes job state.
//
// Safe by default:
// - Binds to loopback unless told otherwise, and answers only requests whose Host is a loopback
//   name, the bind address or an allowed name (http_request.hpp), so a web page cannot read the
//   job through DNS rebinding; others get 403 naming the Host.
// - The provider is called off the server thread by a snapshot_cache (snapshot_cache.hpp), which
//   renders every snapshot page once per snapshot; a request is answered with ready bytes. If the
//   provider throws, snapshot pages answer 500 carrying the message.
// - The server is event driven (no thread per client). Each connection gets `timeout` to send its
//   request head (else 408) and again to take its answer; a head over `max_header_bytes` gets
//   431. At `max_connections`, a new client makes room by closing the oldest connection still
//   waiting for its head (it gets a 503 saying so), so idle or byte-at-a-time clients cannot lock
//   out `troupe ps` / `troupe top`.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/introspection/snapshot.hpp"

namespace troupe::actors {

// Bounds that keep one bad client from hurting the server.
struct http_server_limits {
  std::size_t max_header_bytes = 8192;      // a longer request head is refused with 431
  std::chrono::milliseconds timeout{5000};  // to send the request head, and to take the answer
  int max_connections = 512;  // open at once; then the oldest still sending its head is closed
  // A snapshot page may be answered from a snapshot begun this long before the request came
  // (0: always one begun after it); bounds the load many readers put on the job.
  std::chrono::milliseconds snapshot_max_age{250};
};

struct http_server_options {
  std::string bind = "127.0.0.1";  // listen address
  std::uint16_t port = 0;          // 0: any free port
  // Host names answered besides localhost, 127.0.0.1, [::1] and the bind address ("*": any).
  std::vector<std::string> allowed_hosts;
  http_server_limits limits;
};

class http_server {
 public:
  // Binds `bind`:`port` (port 0: any free port) and starts serving; throws troupe::error naming
  // the address when it cannot bind.
  http_server(std::function<job_snapshot()> provider, std::string bind = "127.0.0.1",
              std::uint16_t port = 0);
  http_server(std::function<job_snapshot()> provider, std::string bind, std::uint16_t port,
              http_server_limits limits);
  http_server(std::function<job_snapshot()> provider, http_server_options options);
  ~http_server();  // stops and joins the server thread
  http_server(const http_server&) = delete;
  http_server& operator=(const http_server&) = delete;

  std::uint16_t port() const;             // the bound port
  std::string endpoint() const;           // "host:port" of the bound socket, e.g. "127.0.0.1:41234"
  std::uint64_t requests_served() const;  // responses written so far (all status codes)
  std::uint64_t snapshots_built() const;  // provider calls so far
  int open_connections() const;           // client connections open now

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::actors
