// Tests of request-head parsing and the Host rule of the introspection endpoint (no sockets).
#include <catch2/catch.hpp>

#include "actors/introspection/http_request.hpp"

using namespace troupe::actors;

namespace {

http_request with_host(std::string host, std::string version = "HTTP/1.1") {
  http_request r;
  r.method = "GET";
  r.path = "/json";
  r.version = std::move(version);
  r.host = std::move(host);
  r.has_host = true;
  return r;
}

}  // namespace

TEST_CASE("A request head parses into method, path, version and Host", "[introspection]") {
  auto p = parse_request_head(
      "GET /json?pretty=1 HTTP/1.1\r\nUser-Agent: x\r\nhOsT:  localhost:9000 \r\n\r\n");
  REQUIRE(p.status == 0);
  CHECK(p.request.method == "GET");
  CHECK(p.request.path == "/json");
  CHECK(p.request.version == "HTTP/1.1");
  CHECK(p.request.has_host);
  CHECK(p.request.host == "localhost:9000");

  auto absolute = parse_request_head("HEAD http://localhost:9000/metrics HTTP/1.0\n\n");
  REQUIRE(absolute.status == 0);
  CHECK(absolute.request.path == "/metrics");
  CHECK_FALSE(absolute.request.has_host);

  CHECK(parse_request_head("GET /json HTTP/1.1 x\r\n\r\n").status == 400);
  CHECK(parse_request_head("GET /json HTTP/2.0\r\n\r\n").status == 505);
  CHECK(parse_request_head("GET /json HTTP/1.1\r\nno colon here\r\n\r\n").status == 400);
  auto twice = parse_request_head("GET / HTTP/1.1\r\nHost: localhost\r\nHost: evil.test\r\n\r\n");
  CHECK(twice.status == 400);
  CHECK_THAT(twice.error, Catch::Contains("more than one Host"));
}

TEST_CASE("Loopback Host names are answered, with the server's port or none", "[introspection]") {
  const host_rule rule = make_host_rule("127.0.0.1", 8123, {});
  for (std::string ok :
       {"localhost", "LocalHost:8123", "127.0.0.1:8123", "127.0.0.1", "[::1]:8123", "[::1]"}) {
    INFO(ok);
    CHECK(check_host(with_host(ok), rule).status == 0);
  }
}

TEST_CASE("Other Host names get 403 naming the Host (DNS rebinding)", "[introspection]") {
  const host_rule rule = make_host_rule("127.0.0.1", 8123, {});
  for (std::string no : {"evil.example:8123", "evil.example", "127.0.0.2:8123", "localhost.evil",
                         "10.1.2.3:8123", "[::2]:8123"}) {
    INFO(no);
    host_verdict v = check_host(with_host(no), rule);
    CHECK(v.status == 403);
    CHECK_THAT(v.error, Catch::Contains("'" + no + "' is not allowed") &&
                            Catch::Contains("--introspection-hosts"));
  }
  host_verdict port = check_host(with_host("localhost:80"), rule);
  CHECK(port.status == 403);
  CHECK_THAT(port.error, Catch::Contains("port 80 is not the server's 8123"));
  CHECK_THAT(port.error, Catch::Contains("answers localhost, 127.0.0.1, [::1] on port 8123"));
  for (std::string malformed : {"[::1", "[::1]x", "localhost:8x", ":8123", "localhost:123456"}) {
    INFO(malformed);
    CHECK(check_host(with_host(malformed), rule).status == 400);
  }
  // Control bytes in a Host never reach the answer.
  host_verdict ctl = check_host(with_host(std::string("ev\x01il\x7f")), rule);
  CHECK(ctl.status == 403);
  CHECK(ctl.error.find('\x01') == std::string::npos);
}

TEST_CASE("The bind address and the allowed names are answered too", "[introspection]") {
  const host_rule rule = make_host_rule("10.0.0.7", 8123, {"Dash.Example", "[fd00::5]", " a.b "});
  for (std::string ok : {"10.0.0.7:8123", "dash.example:8123", "DASH.EXAMPLE", "[fd00::5]:8123",
                         "a.b", "localhost"}) {
    INFO(ok);
    CHECK(check_host(with_host(ok), rule).status == 0);
  }
  CHECK(check_host(with_host("other.example:8123"), rule).status == 403);
  // A wildcard bind adds no name: the host's addresses must be allowed by name.
  CHECK(check_host(with_host("0.0.0.0:8123"), make_host_rule("0.0.0.0", 8123, {})).status == 403);
  // "*" turns the check off.
  CHECK(check_host(with_host("anything:1"), make_host_rule("127.0.0.1", 8123, {"*"})).status == 0);
}

TEST_CASE("HTTP/1.1 needs a Host; HTTP/1.0 may go without", "[introspection]") {
  const host_rule rule = make_host_rule("127.0.0.1", 8123, {});
  http_request r = with_host("");
  r.has_host = false;
  host_verdict v = check_host(r, rule);
  CHECK(v.status == 400);
  CHECK_THAT(v.error, Catch::Contains("Host"));
  r.version = "HTTP/1.0";
  CHECK(check_host(r, rule).status == 0);
  // HTTP/1.0 with a foreign Host is refused like any other.
  CHECK(check_host(with_host("evil.example", "HTTP/1.0"), rule).status == 403);
}
