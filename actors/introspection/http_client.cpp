// The blocking HTTP/1.1 client of http_client.hpp: getaddrinfo, a non-blocking socket and poll()
// against one deadline for the whole exchange.
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>

#include "actors/introspection/http_client.hpp"
#include "actors/introspection/render.hpp"

namespace troupe::actors {
namespace {
using clock = std::chrono::steady_clock;
constexpr std::size_t max_response_bytes = 64u << 20;

struct fd_guard {
  int fd = -1;
  ~fd_guard() {
    if (fd >= 0) ::close(fd);
  }
};

std::string lower(std::string s) {
  for (auto& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string host_port(const std::string& host, std::uint16_t port) {
  bool v6 = host.find(':') != std::string::npos;
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

// A wildcard listen address (what the job registry holds for an endpoint bound to all
// interfaces) is reached, and named in Host, as loopback.
std::string reachable(const std::string& host) {
  if (host == "0.0.0.0") return "127.0.0.1";
  if (host == "::") return "::1";
  return host;
}

// Waits for `events` on fd until the deadline: 1 ready, 0 timed out, -1 error (errno set).
int wait_for(int fd, short events, clock::time_point deadline) {
  for (;;) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock::now());
    if (left.count() <= 0) return 0;
    pollfd p{fd, events, 0};
    int r = ::poll(&p, 1, int(std::min<long long>(left.count() + 1, 1 << 30)));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return r;
    return 1;
  }
}

// Connects to one of the addresses of host:port; the socket, or -1 with `why` set.
int connect_to(const std::string& host, std::uint16_t port, clock::time_point deadline,
               std::string& why) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
  if (rc != 0) {
    why = std::string("cannot resolve host: ") + ::gai_strerror(rc);
    return -1;
  }
  int fd = -1;
  for (addrinfo* ai = res; ai; ai = ai->ai_next) {
    fd = ::socket(ai->ai_family, ai->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      why = std::string("socket: ") + std::strerror(errno);
      continue;
    }
    int r = ::connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (r != 0 && errno == EINPROGRESS) {
      int w = wait_for(fd, POLLOUT, deadline);
      if (w == 1) {
        int err = 0;
        socklen_t len = sizeof err;
        r = ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0 ? 0 : -1;
        errno = err;
      } else {
        why = w == 0 ? "connect timed out" : std::string("poll: ") + std::strerror(errno);
        ::close(fd);
        fd = -1;
        continue;
      }
    }
    if (r == 0) break;
    why = std::string("connect: ") + std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  ::freeaddrinfo(res);
  return fd;
}

// Parses the head of a response; false if it is not one.
bool parse_head(const std::string& head, http_response& r) {
  std::size_t eol = head.find("\r\n");
  std::string status = head.substr(0, eol);
  if (status.rfind("HTTP/1.", 0) != 0 || status.size() < 12 || status[8] != ' ') return false;
  if (!std::isdigit((unsigned char)status[9]) || !std::isdigit((unsigned char)status[10]) ||
      !std::isdigit((unsigned char)status[11]))
    return false;
  r.status = std::stoi(status.substr(9, 3));
  r.reason = status.size() > 13 ? status.substr(13) : "";
  std::size_t pos = eol == std::string::npos ? head.size() : eol + 2;
  while (pos < head.size()) {
    std::size_t end = head.find("\r\n", pos);
    if (end == std::string::npos) end = head.size();
    std::string line = head.substr(pos, end - pos);
    std::size_t colon = line.find(':');
    if (colon != std::string::npos) {
      std::string value = line.substr(colon + 1);
      value.erase(0, value.find_first_not_of(" \t"));
      value.erase(value.find_last_not_of(" \t") + 1);
      r.headers[lower(line.substr(0, colon))] = value;
    }
    pos = end + 2;
  }
  return true;
}

}  // namespace

expected<http_response> http_exchange(const std::string& given_host, std::uint16_t port,
                                      const std::string& request,
                                      std::chrono::milliseconds timeout) {
  using result = expected<http_response>;
  const std::string host = reachable(given_host);
  auto deadline = clock::now() + timeout;
  std::string where = "http://" + host_port(host, port);
  std::string why;
  fd_guard s{connect_to(host, port, deadline, why)};
  if (s.fd < 0) return result::failure(where + ": " + why);

  for (std::size_t sent = 0; sent < request.size();) {
    ssize_t n = ::send(s.fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n > 0) {
      sent += std::size_t(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      int w = wait_for(s.fd, POLLOUT, deadline);
      if (w == 0) return result::failure(where + ": timed out sending the request");
      if (w < 0) return result::failure(where + ": poll: " + std::strerror(errno));
      continue;
    }
    // The server may answer and close before reading everything (e.g. a refused request).
    if (errno == EPIPE || errno == ECONNRESET) break;
    return result::failure(where + ": send: " + std::strerror(errno));
  }

  bool head_only = request.rfind("HEAD ", 0) == 0;
  std::string data;
  http_response r;
  std::size_t head_end = std::string::npos;
  long long length = -1;
  char buf[16384];
  for (;;) {
    if (head_end != std::string::npos &&
        (head_only || (length >= 0 && data.size() - head_end >= std::size_t(length))))
      break;  // the whole response is here
    ssize_t n = ::recv(s.fd, buf, sizeof buf, 0);
    if (n > 0) {
      data.append(buf, std::size_t(n));
      if (data.size() > max_response_bytes)
        return result::failure(where + ": response larger than " +
                               std::to_string(max_response_bytes) + " bytes");
      if (head_end == std::string::npos) {
        std::size_t e = data.find("\r\n\r\n");
        if (e != std::string::npos) {
          if (!parse_head(data.substr(0, e), r))
            return result::failure(where + ": the answer is not an HTTP/1.x response");
          head_end = e + 4;
          auto it = r.headers.find("content-length");
          if (it != r.headers.end()) {
            char* end = nullptr;
            length = std::strtoll(it->second.c_str(), &end, 10);
            if (end == it->second.c_str() || *end || length < 0) length = -1;
          }
        }
      }
      continue;
    }
    if (n == 0) break;  // closed by the server
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int w = wait_for(s.fd, POLLIN, deadline);
      if (w == 0)
        return result::failure(where + ": timed out after " + std::to_string(timeout.count()) +
                               " ms waiting for the response");
      if (w < 0) return result::failure(where + ": poll: " + std::strerror(errno));
      continue;
    }
    if (errno == ECONNRESET && head_end != std::string::npos) break;
    return result::failure(where + ": recv: " + std::strerror(errno));
  }
  if (head_end == std::string::npos) {
    if (data.empty()) return result::failure(where + ": the server closed without answering");
    return result::failure(where + ": incomplete HTTP response (" + std::to_string(data.size()) +
                           " bytes)");
  }
  r.body = data.substr(head_end);
  if (!head_only && length >= 0) {
    if (r.body.size() < std::size_t(length))
      return result::failure(where + ": response body cut short (" + std::to_string(r.body.size()) +
                             " of " + std::to_string(length) + " bytes)");
    r.body.resize(std::size_t(length));
  }
  return r;
}

expected<std::string> http_get(const std::string& given_host, std::uint16_t port,
                               const std::string& path, std::chrono::milliseconds timeout) {
  const std::string host = reachable(given_host);
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: " + host_port(host, port) +
                    "\r\nUser-Agent: troupe\r\nAccept: */*\r\nConnection: close\r\n\r\n";
  auto r = http_exchange(host, port, req, timeout);
  if (!r) return expected<std::string>::failure(r.error_message());
  if (r->status != 200) {
    std::string body = r->body.substr(0, 300);
    while (!body.empty() && std::isspace((unsigned char)body.back())) body.pop_back();
    return expected<std::string>::failure("GET http://" + host_port(host, port) + path + ": " +
                                          std::to_string(r->status) + " " + r->reason +
                                          (body.empty() ? "" : ": " + body));
  }
  return std::move(r->body);
}

expected<job_snapshot> fetch_snapshot(const std::string& host, std::uint16_t port,
                                      std::chrono::milliseconds timeout) {
  auto r = http_get(host, port, "/json", timeout);
  if (!r) return expected<job_snapshot>::failure(r.error_message());
  return snapshot_from_json(*r, "http://" + host_port(host, port) + "/json");
}

expected<std::pair<std::string, std::uint16_t>> parse_endpoint(const std::string& ep) {
  using result = expected<std::pair<std::string, std::uint16_t>>;
  auto bad = [&](const char* why) {
    return result::failure("endpoint '" + ep + "' is not HOST:PORT (" + why + ")");
  };
  std::string host, port;
  if (!ep.empty() && ep[0] == '[') {
    std::size_t close = ep.find(']');
    if (close == std::string::npos || close + 1 >= ep.size() || ep[close + 1] != ':')
      return bad("an IPv6 address is written [addr]:port");
    host = ep.substr(1, close - 1);
    port = ep.substr(close + 2);
  } else {
    std::size_t colon = ep.rfind(':');
    if (colon == std::string::npos) return bad("no ':'");
    host = ep.substr(0, colon);
    port = ep.substr(colon + 1);
    if (host.find(':') != std::string::npos) return bad("an IPv6 address is written [addr]:port");
  }
  if (host.empty()) return bad("empty host");
  if (port.empty() || port.size() > 5 ||
      !std::all_of(port.begin(), port.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return bad("the port is not a number");
  int p = std::stoi(port);
  if (p < 1 || p > 65535) return bad("the port is not in 1..65535");
  return std::pair<std::string, std::uint16_t>(host, std::uint16_t(p));
}

}  // namespace troupe::actors
