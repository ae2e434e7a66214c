// A tiny blocking HTTP/1.1 client for the introspection endpoint (`troupe ps`, `troupe top`,
// tests): one request per connection, a deadline over the whole exchange, POSIX sockets.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "actors/introspection/snapshot.hpp"
#include "memory/error.hpp"

namespace troupe::actors {

struct http_response {
  int status = 0;
  std::string reason;
  std::map<std::string, std::string> headers;  // names in lower case
  std::string body;
};

// Sends `request` (the raw bytes of a request, head and body) and reads the response until the
// server closes the connection or the timeout passes. Failures name host:port. A wildcard host
// (0.0.0.0, ::: an endpoint bound to every interface) is reached as loopback.
expected<http_response> http_exchange(const std::string& host, std::uint16_t port,
                                      const std::string& request,
                                      std::chrono::milliseconds timeout);

// GET `path`: the body when the status is 200, else a failure naming the status and the URL.
expected<std::string> http_get(const std::string& host, std::uint16_t port, const std::string& path,
                               std::chrono::milliseconds timeout);

// GET /json from a job's endpoint and parse it; failures name the URL.
expected<job_snapshot> fetch_snapshot(const std::string& host, std::uint16_t port,
                                      std::chrono::milliseconds timeout);

// "host:port", "[v6addr]:port" -> host and port; a failure that quotes the text.
expected<std::pair<std::string, std::uint16_t>> parse_endpoint(const std::string& endpoint);

}  // namespace troupe::actors
