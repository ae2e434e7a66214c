// The request head of the introspection endpoint, parsed and checked without any socket: the
// request line, the Host header and the rule that decides which Host names are answered.
//
// Host rule (against DNS rebinding: a web page whose name an attacker points at 127.0.0.1 must
// not read the job): a request is answered when its Host names a loopback address (localhost,
// 127.0.0.1, [::1]), the address the server is bound to, or a name of the allowed list ("*" in
// the list turns the check off); a port, when given, must be the server's. HTTP/1.1 without
// Host is a bad request (RFC 9112); HTTP/1.0 without Host is answered (browsers always send it).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::actors {

struct http_request {
  std::string method;   // "GET", "HEAD", ...
  std::string path;     // target without query or fragment ("/json")
  std::string version;  // "HTTP/1.1" or "HTTP/1.0"
  std::string host;     // the Host header as sent ("localhost:8080"), empty when absent
  bool has_host = false;
};

// A parsed head, or the status (400, 505) and text to answer instead.
struct parsed_request {
  http_request request;
  int status = 0;     // 0: parsed
  std::string error;  // why, when status != 0
};

// Parses a request head (request line and header lines, up to the empty line).
parsed_request parse_request_head(std::string_view head);

// The names a Host header may carry besides the loopback ones: the bind address when it is a
// specific one, plus `allowed` (as configured, e.g. from `troupe launch --introspection-hosts`).
struct host_rule {
  std::vector<std::string> names;  // lower case, IPv6 addresses without brackets
  bool any = false;                // "*" was allowed
  std::uint16_t port = 0;          // the server's port
};
host_rule make_host_rule(const std::string& bind, std::uint16_t port,
                         const std::vector<std::string>& allowed);

// Whether `request` may be answered: status 0, else 403 (a Host not allowed, named in the text)
// or 400 (no Host in HTTP/1.1, several, or one that is not host[:port]).
struct host_verdict {
  int status = 0;
  std::string error;
};
host_verdict check_host(const http_request& request, const host_rule& rule);

}  // namespace troupe::actors
