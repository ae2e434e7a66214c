// Tests of the introspection HTTP endpoint: a real server on a free loopback port, real sockets.
#include <catch2/catch.hpp>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "actors/introspection/exposition_check.test.hpp"
#include "actors/introspection/http_client.hpp"
#include "actors/introspection/http_server.hpp"
#include "actors/introspection/render.hpp"
#include "actors/introspection/sample_snapshot.test.hpp"

using namespace troupe::actors;
using namespace troupe::actors::testing;
using namespace std::chrono_literals;

namespace {

const std::string loopback = "127.0.0.1";

http_response send_raw(const http_server& s, const std::string& request) {
  auto r = http_exchange(loopback, s.port(), request, 5s);
  INFO(request.substr(0, 80));
  REQUIRE(r.has_value());
  return *r;
}

http_response get(const http_server& s, const std::string& path) {
  return send_raw(s, "GET " + path + " HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
}

// A non-loopback IPv4 address of this host, or "" when it has none.
std::string other_address() {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0) return "";
  std::string found;
  for (ifaddrs* i = all; i && found.empty(); i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    auto* in = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
    if ((ntohl(in->sin_addr.s_addr) >> 24) == 127) continue;
    char buf[INET_ADDRSTRLEN];
    if (inet_ntop(AF_INET, &in->sin_addr, buf, sizeof buf)) found = buf;
  }
  freeifaddrs(all);
  return found;
}

}  // namespace

TEST_CASE("The endpoint serves JSON that reads back as the provider snapshot", "[introspection]") {
  const job_snapshot want = sample_snapshot();
  std::atomic<int> calls{0};
  http_server server([&] {
    ++calls;
    return want;
  });
  auto r = get(server, "/json");
  CHECK(r.status == 200);
  CHECK(r.headers["content-type"] == "application/json");
  auto back = snapshot_from_json(r.body, "/json");
  REQUIRE(back.has_value());
  check_equal(want, *back);
  CHECK(calls == 1);
}

TEST_CASE("Readers within the snapshot age share one snapshot; others get a fresh one",
          "[introspection]") {
  std::atomic<int> calls{0};
  auto provider = [&] {
    ++calls;
    return sample_snapshot();
  };
  http_server_options shared;
  shared.limits.snapshot_max_age = std::chrono::hours(1);
  {
    http_server server(provider, shared);
    for (const char* path : {"/json", "/metrics", "/table", "/json?x=1"})
      REQUIRE(http_get(loopback, server.port(), path, 5s).has_value());
    CHECK(calls == 1);  // one snapshot rendered every page
    CHECK(server.snapshots_built() == 1);
  }
  calls = 0;
  http_server_options fresh;
  fresh.limits.snapshot_max_age = 0ms;
  http_server server(provider, fresh);
  for (int i = 0; i < 3; ++i) REQUIRE(http_get(loopback, server.port(), "/json", 5s).has_value());
  CHECK(calls == 3);  // each request came after the last snapshot began
}

TEST_CASE("A slow snapshot holds up only the readers of snapshot pages", "[introspection]") {
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> entered;
  std::atomic<int> calls{0};
  http_server server([&] {
    if (++calls == 1) {
      entered.set_value();
      released.wait();  // the first snapshot hangs until the test lets it go
    }
    return sample_snapshot();
  });
  auto first = std::async(std::launch::async,
                          [&] { return http_get(loopback, server.port(), "/json", 30s); });
  REQUIRE(entered.get_future().wait_for(30s) == std::future_status::ready);
  auto second = std::async(std::launch::async,
                           [&] { return http_get(loopback, server.port(), "/metrics", 30s); });
  // Meanwhile the server answers everything else.
  CHECK(get(server, "/healthz").status == 200);
  CHECK(get(server, "/nope").status == 404);
  CHECK(send_raw(server, "DELETE /json HTTP/1.1\r\nHost: localhost\r\n\r\n").status == 405);
  CHECK(first.wait_for(0s) == std::future_status::timeout);
  release.set_value();
  auto a = first.get();
  auto b = second.get();
  REQUIRE(a.has_value());
  REQUIRE(b.has_value());
  CHECK(snapshot_from_json(*a, "first").has_value());
  CHECK(parse_exposition(*b).error.empty());
}

TEST_CASE("The endpoint serves Prometheus text that parses", "[introspection]") {
  const job_snapshot want = sample_snapshot();
  http_server server([&] { return want; });
  auto r = get(server, "/metrics");
  CHECK(r.status == 200);
  CHECK_THAT(r.headers["content-type"], Catch::StartsWith("text/plain; version=0.0.4"));
  auto body = http_get(loopback, server.port(), "/metrics", 5s);
  REQUIRE(body.has_value());
  CHECK(*body == r.body);
  exposition e = parse_exposition(*body);
  INFO(*body);
  REQUIRE(e.error.empty());
  CHECK(e.value("troupe_actor_mailbox_depth",
                {{"actor", "stage/1"}, {"role", "stage"}, {"rank", "1"}}) == 2);
  CHECK(e.value("troupe_actor_bytes_sent_total", {{"actor", "coordinator"}}) == 1234567);
  CHECK(e.value("troupe_actor_mailbox_depth", {{"actor", want.actors[2].name}}) == 12345);
}

TEST_CASE("The endpoint serves a page with every actor and a health check", "[introspection]") {
  http_server server([] { return sample_snapshot(); });
  auto page = get(server, "/table");
  CHECK(page.status == 200);
  CHECK_THAT(page.headers["content-type"], Catch::StartsWith("text/html"));
  CHECK(page.body.find("stage/1") != std::string::npos);
  CHECK(page.body.find("coordinator") != std::string::npos);
  CHECK(page.body.find("refresh") != std::string::npos);
  auto health = get(server, "/healthz");
  CHECK(health.status == 200);
  CHECK(health.body == "ok\n");
}

TEST_CASE("HEAD gets the headers of GET without a body", "[introspection]") {
  http_server server([] { return sample_snapshot(); });
  auto full = get(server, "/json");
  auto head = send_raw(server, "HEAD /json HTTP/1.1\r\nHost: localhost\r\n\r\n");
  CHECK(head.status == 200);
  CHECK(head.body.empty());
  CHECK(head.headers["content-length"] == std::to_string(full.body.size()));
}

TEST_CASE("Methods other than GET and HEAD get 405 naming the allowed ones, on every path",
          "[introspection]") {
  std::atomic<int> calls{0};
  http_server server([&] {
    ++calls;
    return sample_snapshot();
  });
  for (std::string path : {"/", "/table", "/json", "/metrics", "/healthz", "/nope"})
    for (std::string method :
         std::vector<std::string>{"POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "get"}) {
      INFO(method << " " << path);
      auto r = send_raw(server, method + " " + path +
                                    " HTTP/1.1\r\nHost: localhost\r\nContent-Length: 11\r\n\r\n" +
                                    "{\"kill\":1}\n");
      CHECK(r.status == 405);
      CHECK_THAT(r.headers["allow"], Catch::Contains("GET"));
    }
  CHECK(calls == 0);  // nothing reached the job
}

TEST_CASE("A request naming a foreign Host gets 403 naming it, and nothing of the job",
          "[introspection]") {
  std::atomic<int> calls{0};
  http_server server([&] {
    ++calls;
    return sample_snapshot();
  });
  const std::string port = std::to_string(server.port());
  for (std::string path : {"/", "/table", "/json", "/metrics"}) {
    INFO(path);
    auto r =
        send_raw(server, "GET " + path + " HTTP/1.1\r\nHost: rebound.example:" + port + "\r\n\r\n");
    CHECK(r.status == 403);
    CHECK_THAT(r.body, Catch::Contains("'rebound.example:" + port + "' is not allowed"));
    CHECK(r.body.find("stage/1") == std::string::npos);
  }
  CHECK(calls == 0);
  // No Host in HTTP/1.1 is a bad request; HTTP/1.0 without one is answered.
  CHECK(send_raw(server, "GET /json HTTP/1.1\r\n\r\n").status == 400);
  CHECK(send_raw(server, "GET /healthz HTTP/1.0\r\n\r\n").status == 200);
  // The names a client of this server sends are all fine.
  for (std::string host : {"localhost:" + port, "127.0.0.1:" + port, "[::1]:" + port})
    CHECK(send_raw(server, "GET /json HTTP/1.1\r\nHost: " + host + "\r\n\r\n").status == 200);

  // Names allowed by the options are answered.
  http_server_options o;
  o.allowed_hosts = {"rebound.example"};
  http_server allowing([] { return sample_snapshot(); }, o);
  auto r = http_exchange(
      loopback, allowing.port(),
      "GET /json HTTP/1.1\r\nHost: rebound.example:" + std::to_string(allowing.port()) + "\r\n\r\n",
      5s);
  REQUIRE(r.has_value());
  CHECK(r->status == 200);
}

TEST_CASE("Unknown paths get 404", "[introspection]") {
  http_server server([] { return sample_snapshot(); });
  CHECK(get(server, "/nope").status == 404);
  CHECK(get(server, "/json/extra").status == 404);
  CHECK(get(server, "/../etc/passwd").status == 404);
  auto r = http_get(loopback, server.port(), "/missing", 5s);
  REQUIRE_FALSE(r.has_value());
  CHECK_THAT(r.error_message(), Catch::Contains("404") && Catch::Contains("/missing"));
}

TEST_CASE("A provider that throws gives 500 with its message", "[introspection]") {
  http_server server([]() -> job_snapshot { throw std::runtime_error("coordinator is gone"); });
  auto r = get(server, "/json");
  CHECK(r.status == 500);
  CHECK_THAT(r.body, Catch::Contains("coordinator is gone"));
  CHECK(get(server, "/metrics").status == 500);
  CHECK(get(server, "/healthz").status == 200);
}

TEST_CASE("An oversized request is refused and the server keeps serving", "[introspection]") {
  http_server server([] { return sample_snapshot(); });
  std::string big =
      "GET /json HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(20000, 'a') + "\r\n\r\n";
  auto r = send_raw(server, big);
  CHECK((r.status == 431 || r.status == 400));
  // A head just under the limit is still served.
  std::string fits =
      "GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + std::string(7000, 'b') + "\r\n\r\n";
  CHECK(send_raw(server, fits).status == 200);
  // A request line without any end, far over the limit.
  auto r2 = send_raw(server, std::string(100000, 'G'));
  CHECK((r2.status == 431 || r2.status == 400));
  CHECK(get(server, "/healthz").status == 200);
}

TEST_CASE("Garbage requests get 400 or a closed connection and never stop the server",
          "[introspection]") {
  http_server server([] { return sample_snapshot(); });
  const std::vector<std::string> garbage = {
      "\r\n\r\n",
      "GET\r\n\r\n",
      "GET /json\r\n\r\n",
      "GET /json HTTP/1.1 extra\r\n\r\n",
      "GET /json FTP/1.0\r\n\r\n",
      " /json HTTP/1.1\r\n\r\n",
      std::string("\x00\x01\x02\xff\xfe\r\n\r\n", 8),
      std::string("GET /j\x00son HTTP/1.1\r\n\r\n", 23),
      "GET /json HTTP/1.1\r\n",  // never ends: closed at the timeout or when we close
  };
  for (const auto& g : garbage) {
    auto r = http_exchange(loopback, server.port(), g, 300ms);
    if (r.has_value()) CHECK(r->status >= 400);
  }
  CHECK(send_raw(server, "GET /json HTTP/2.0\r\n\r\n").status == 505);
  // Bytes from a random generator, a few hundred of them, many times.
  std::uint64_t x = 88172645463325252ull;
  for (int i = 0; i < 50; ++i) {
    std::string junk(64 + i * 37, '\0');
    for (auto& c : junk) {
      x ^= x << 13, x ^= x >> 7, x ^= x << 17;
      c = char(x);
    }
    auto r = http_exchange(loopback, server.port(), junk + "\r\n\r\n", 1s);
    if (r.has_value()) CHECK(r->status >= 400);
  }
  // Clients that connect and leave at once.
  for (int i = 0; i < 20; ++i) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(server.port());
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    CHECK(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
    ::close(fd);
  }
  CHECK(get(server, "/healthz").status == 200);
  CHECK(get(server, "/json").status == 200);
}

TEST_CASE("A connection without a whole head in time gets 408 and is closed", "[introspection]") {
  http_server_limits limits;
  limits.timeout = 300ms;
  http_server server([] { return sample_snapshot(); }, "127.0.0.1", 0, limits);
  auto r = http_exchange(loopback, server.port(), "GET /json HTTP/1.1\r\n", 30s);
  REQUIRE(r.has_value());
  CHECK(r->status == 408);
  CHECK_THAT(r->body, Catch::Contains("no complete request head within 300 ms"));
  auto silent = http_exchange(loopback, server.port(), "", 30s);
  REQUIRE(silent.has_value());
  CHECK(silent->status == 408);
  CHECK(get(server, "/healthz").status == 200);
}

TEST_CASE("Many clients at once all get their answer", "[introspection]") {
  http_server server([] { return sample_snapshot(); });
  const std::string want = to_json(sample_snapshot()) + "\n";
  std::atomic<int> good{0};
  std::mutex mu;
  std::string first_problem;
  std::vector<std::thread> clients;
  for (int t = 0; t < 8; ++t)
    clients.emplace_back([&] {
      for (int i = 0; i < 25; ++i) {
        auto r = http_get(loopback, server.port(), "/json", 10s);
        if (r && *r == want) {
          ++good;
          continue;
        }
        std::lock_guard lk(mu);
        if (first_problem.empty())
          first_problem = r ? "wrong body: " + r->substr(0, 200) : r.error_message();
      }
    });
  for (auto& c : clients) c.join();
  INFO(first_problem);
  CHECK(good == 200);
  // A response is counted when its write completes, which may be just after the client read it.
  // Polled (the count has no event); the deadline only guards against a hang.
  auto until = std::chrono::steady_clock::now() + 60s;
  while (server.requests_served() < 200 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(1ms);
  CHECK(server.requests_served() >= 200);
}

TEST_CASE("The server binds to loopback by default", "[introspection]") {
  http_server server([] { return sample_snapshot(); });
  CHECK(server.port() != 0);
  CHECK(server.endpoint() == "127.0.0.1:" + std::to_string(server.port()));
  auto ep = parse_endpoint(server.endpoint());
  REQUIRE(ep.has_value());
  CHECK(http_get(ep->first, ep->second, "/healthz", 5s).has_value());
  std::string other = other_address();
  if (other.empty()) {
    WARN("no non-loopback IPv4 address: not checking that it is unreachable there");
  } else {
    auto r = http_get(other, server.port(), "/healthz", 2s);
    CHECK_FALSE(r.has_value());
  }
}

TEST_CASE("A bind address that cannot be used is an error naming it", "[introspection]") {
  http_server first([] { return job_snapshot{}; });
  auto taken = [&] {
    http_server second([] { return job_snapshot{}; }, "127.0.0.1", first.port());
  };
  CHECK_THROWS_WITH(taken(), Catch::Contains("127.0.0.1:" + std::to_string(first.port())));
  CHECK_THROWS_WITH(http_server([] { return job_snapshot{}; }, "no.such.host.invalid", 0),
                    Catch::Contains("no.such.host.invalid"));
}

TEST_CASE("Endpoints parse as host and port", "[introspection]") {
  auto a = parse_endpoint("127.0.0.1:8080");
  REQUIRE(a.has_value());
  CHECK(a->first == "127.0.0.1");
  CHECK(a->second == 8080);
  auto b = parse_endpoint("[::1]:9");
  REQUIRE(b.has_value());
  CHECK(b->first == "::1");
  CHECK(b->second == 9);
  for (std::string bad :
       {"", "host", "host:", ":80", "host:0", "host:65536", "host:8x", "::1:80"}) {
    INFO(bad);
    auto r = parse_endpoint(bad);
    REQUIRE_FALSE(r.has_value());
    CHECK_THAT(r.error_message(), Catch::Contains("'" + bad + "'"));
  }
}

TEST_CASE("A client of a closed port fails naming the address", "[introspection]") {
  std::uint16_t port;
  {
    http_server s([] { return job_snapshot{}; });
    port = s.port();
  }
  auto r = http_get(loopback, port, "/json", 2s);
  REQUIRE_FALSE(r.has_value());
  CHECK_THAT(r.error_message(), Catch::Contains("127.0.0.1:" + std::to_string(port)));
}

TEST_CASE("An answer slower than the timeout is still written", "[introspection]") {
  http_server_limits limits;
  limits.timeout = 300ms;
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  std::promise<void> entered;
  http_server server(
      [&] {
        entered.set_value();
        released.wait();
        return sample_snapshot();
      },
      "127.0.0.1", 0, limits);
  auto slow = std::async(std::launch::async,
                         [&] { return http_get(loopback, server.port(), "/json", 30s); });
  REQUIRE(entered.get_future().wait_for(30s) == std::future_status::ready);
  // A silent client's 408 says the timeout has passed; only then does the snapshot come.
  auto silent = http_exchange(loopback, server.port(), "", 30s);
  REQUIRE(silent.has_value());
  CHECK(silent->status == 408);
  release.set_value();
  auto r = slow.get();
  REQUIRE(r.has_value());
  CHECK(snapshot_from_json(*r, "slow").has_value());
}

TEST_CASE("A server bound to every interface is read through its registered endpoint",
          "[introspection]") {
  http_server server([] { return sample_snapshot(); }, "0.0.0.0", 0);
  CHECK(server.endpoint() == "0.0.0.0:" + std::to_string(server.port()));
  auto ep = parse_endpoint(server.endpoint());
  REQUIRE(ep.has_value());
  auto snap = fetch_snapshot(ep->first, ep->second, 5s);  // what `troupe ps` does
  INFO((snap ? "" : snap.error_message()));
  CHECK(snap.has_value());
}

TEST_CASE("A server bound to a non-loopback address answers requests naming it",
          "[introspection]") {
  std::string other = other_address();
  if (other.empty()) {
    WARN("no non-loopback IPv4 address: not checking a server bound to one");
    return;
  }
  http_server server([] { return sample_snapshot(); }, other, 0);
  auto r = http_get(other, server.port(), "/json", 5s);
  INFO((r ? "" : r.error_message()));
  CHECK(r.has_value());
  auto foreign = http_exchange(other, server.port(),
                               "GET /json HTTP/1.1\r\nHost: rebound.example\r\n\r\n", 5s);
  REQUIRE(foreign.has_value());
  CHECK(foreign->status == 403);
}
