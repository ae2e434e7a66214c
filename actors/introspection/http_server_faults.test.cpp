// The introspection endpoint under many idle and slow (byte-at-a-time) clients: `troupe ps` and
// `troupe top` requests are still answered, and every slow client is answered or told why not.
#include <catch2/catch.hpp>

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "actors/introspection/http_client.hpp"
#include "actors/introspection/http_server.hpp"
#include "actors/introspection/render.hpp"
#include "actors/introspection/sample_snapshot.test.hpp"

using namespace troupe::actors;
using namespace troupe::actors::testing;
using namespace std::chrono_literals;

namespace {

const std::string loopback = "127.0.0.1";
const std::string request = "GET /json HTTP/1.1\r\nHost: localhost\r\n\r\n";

// A client socket driven by hand, byte by byte if need be.
struct raw_client {
  int fd = -1;
  explicit raw_client(std::uint16_t port) {
    fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  }
  ~raw_client() {
    if (fd >= 0) ::close(fd);
  }
  raw_client(const raw_client&) = delete;
  raw_client& operator=(const raw_client&) = delete;

  bool send(const std::string& bytes) {
    return ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL) == ssize_t(bytes.size());
  }
  // Whether the server has sent something (or closed) by now.
  bool readable() {
    pollfd p{fd, POLLIN, 0};
    return ::poll(&p, 1, 0) == 1;
  }
  // Everything the server sends until it closes; the guard only stops a hang.
  std::string read_to_close(std::string& how) {
    std::string out;
    char buf[16384];
    for (;;) {
      pollfd p{fd, POLLIN, 0};
      int r = ::poll(&p, 1, 30000);
      if (r == 0) {
        how = "no close within the guard";
        return out;
      }
      ssize_t n = ::recv(fd, buf, sizeof buf, 0);
      if (n > 0) {
        out.append(buf, std::size_t(n));
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      how = n == 0 ? "closed" : std::string("recv: ") + std::strerror(errno);
      return out;
    }
  }
};

// "200" and the JSON of a job snapshot, or why not.
std::string check_json_answer(const std::string& bytes) {
  if (bytes.rfind("HTTP/1.1 200 ", 0) != 0) return "not a 200: " + bytes.substr(0, 200);
  std::size_t body = bytes.find("\r\n\r\n");
  if (body == std::string::npos) return "no end of head";
  auto s = snapshot_from_json(bytes.substr(body + 4), "slow client");
  return s ? "" : s.error_message();
}

// What `troupe ps` does (GET /json, parse, render the table) and what `troupe top` does.
void ps_and_top(const http_server& server) {
  auto ps = http_get(loopback, server.port(), "/json", 30s);
  REQUIRE(ps.has_value());
  auto snap = snapshot_from_json(*ps, "ps");
  REQUIRE(snap.has_value());
  CHECK(render_table(*snap, 0).find("stage/1") != std::string::npos);
  auto top = fetch_snapshot(loopback, server.port(), 30s);
  REQUIRE(top.has_value());
}

}  // namespace

TEST_CASE("200 idle and byte-at-a-time clients do not lock out troupe ps and top",
          "[introspection][faults]") {
  http_server_options o;
  o.limits.timeout = 120s;  // long: the 200 must stay open while ps and top are checked
  http_server server([] { return sample_snapshot(); }, o);
  std::vector<std::unique_ptr<raw_client>> idle, slow;
  for (int i = 0; i < 100; ++i) idle.push_back(std::make_unique<raw_client>(server.port()));
  for (int i = 0; i < 100; ++i) slow.push_back(std::make_unique<raw_client>(server.port()));

  // Each round, every slow client sends one more byte of its head, then ps and top ask.
  const std::size_t rounds = 12;
  for (std::size_t k = 0; k < rounds; ++k) {
    for (auto& c : slow) REQUIRE(c->send(request.substr(k, 1)));
    ps_and_top(server);
  }
  CHECK(server.open_connections() >= 200);  // all held open by the server meanwhile

  // Then each finishes its request (the slow ones still a byte at a time) and gets its answer.
  for (auto& c : idle) REQUIRE(c->send(request));
  for (std::size_t k = rounds; k < request.size(); ++k)
    for (auto& c : slow) REQUIRE(c->send(request.substr(k, 1)));
  int answered = 0;
  std::string problem;
  for (auto* group : {&idle, &slow})
    for (auto& c : *group) {
      std::string how;
      std::string why = check_json_answer(c->read_to_close(how));
      if (why.empty()) {
        ++answered;
      } else if (problem.empty()) {
        problem = why + " (" + how + ")";
      }
    }
  INFO(problem);
  CHECK(answered == 200);
  std::printf(
      "faults: 200 slow HTTP clients (100 idle, 100 byte-at-a-time) -> survived: troupe ps and "
      "top answered in each of %zu rounds while all were open; then %d of 200 got their /json\n",
      rounds, answered);
}

TEST_CASE("Over the connection cap the oldest unfinished heads make room for troupe ps",
          "[introspection][faults]") {
  http_server_options o;
  o.limits.timeout = 120s;
  o.limits.max_connections = 64;  // the old cap, which 64 idle clients used to fill
  http_server server([] { return sample_snapshot(); }, o);
  std::vector<std::unique_ptr<raw_client>> clients;
  for (int i = 0; i < 200; ++i) {
    clients.push_back(std::make_unique<raw_client>(server.port()));
    if (i % 2) REQUIRE(clients.back()->send("G"));  // half have begun a request
  }
  ps_and_top(server);

  // The oldest were closed with a 503 that says why; the others then finish and are answered.
  int refused = 0, answered = 0;
  std::string refusal, problem;
  std::vector<raw_client*> open;
  for (std::size_t i = 0; i < clients.size(); ++i) {
    auto& c = clients[i];
    if (!c->readable()) {
      REQUIRE(c->send(i % 2 ? request.substr(1) : request));
      open.push_back(c.get());
      continue;
    }
    std::string how;
    std::string bytes = c->read_to_close(how);
    if (bytes.rfind("HTTP/1.1 503 ", 0) == 0 &&
        bytes.find("closed to make room for a new client") != std::string::npos) {
      ++refused;
      if (refusal.empty()) refusal = bytes.substr(bytes.find("\r\n\r\n") + 4);
    } else if (problem.empty()) {
      problem = "client " + std::to_string(i) + ": " + bytes.substr(0, 200) + " (" + how + ")";
    }
  }
  for (raw_client* c : open) {
    std::string how;
    std::string why = check_json_answer(c->read_to_close(how));
    if (why.empty())
      ++answered;
    else if (problem.empty())
      problem = why + " (" + how + ")";
  }
  INFO(problem);
  CHECK(refused + answered == 200);
  CHECK(refused >= 200 - 64);
  CHECK(answered >= 1);
  while (!refusal.empty() && (refusal.back() == '\n' || refusal.back() == '\r')) refusal.pop_back();
  std::printf(
      "faults: 200 slow HTTP clients over a 64-connection cap -> refused: %d oldest got 503 "
      "\"%s\"; "
      "troupe ps and top answered; the other %d got their /json\n",
      refused, refusal.c_str(), answered);
}
