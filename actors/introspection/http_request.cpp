// Parsing and checking of request heads (http_request.hpp).
#include "actors/introspection/http_request.hpp"

#include <algorithm>
#include <cctype>

namespace troupe::actors {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (auto& c : out) c = char(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r'))
    s.remove_suffix(1);
  return s;
}

// "[v6]" -> "v6"; other names as they are.
std::string_view unbracket(std::string_view s) {
  if (s.size() >= 2 && s.front() == '[' && s.back() == ']') return s.substr(1, s.size() - 2);
  return s;
}

parsed_request bad(int status, std::string why) {
  parsed_request p;
  p.status = status;
  p.error = std::move(why);
  return p;
}

// Printable text only: a Host quoted in an answer must not carry control bytes.
std::string printable(std::string_view s) {
  std::string out;
  for (char c : s.substr(0, 200)) out += (c >= 0x20 && c < 0x7f) ? c : '?';
  return out;
}

}  // namespace

parsed_request parse_request_head(std::string_view head) {
  std::size_t eol = head.find('\n');
  std::string_view line = head.substr(0, eol);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  std::size_t sp1 = line.find(' ');
  std::size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == 0 || sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != line.npos)
    return bad(400, "malformed request line");
  std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                   version = line.substr(sp2 + 1);
  if (version.substr(0, 5) != "HTTP/" || target.empty()) return bad(400, "malformed request line");
  if (version != "HTTP/1.1" && version != "HTTP/1.0")
    return bad(505, "only HTTP/1.0 and HTTP/1.1 are served");
  parsed_request p;
  p.request.method = std::string(method);
  p.request.version = std::string(version);
  if (target.substr(0, 7) == "http://") {  // absolute form: keep the path
    std::size_t slash = target.find('/', 7);
    target = slash == target.npos ? "/" : target.substr(slash);
  }
  p.request.path = std::string(target.substr(0, target.find_first_of("?#")));

  // Header lines: only Host matters here.
  std::size_t pos = eol == std::string_view::npos ? head.size() : eol + 1;
  while (pos < head.size()) {
    std::size_t end = head.find('\n', pos);
    if (end == std::string_view::npos) end = head.size();
    std::string_view h = head.substr(pos, end - pos);
    pos = end + 1;
    if (trim(h).empty()) break;  // the empty line that ends the head
    std::size_t colon = h.find(':');
    if (colon == std::string_view::npos) return bad(400, "malformed header line");
    if (lower(h.substr(0, colon)) != "host") continue;
    if (p.request.has_host) return bad(400, "more than one Host header");
    p.request.has_host = true;
    p.request.host = std::string(trim(h.substr(colon + 1)));
  }
  return p;
}

host_rule make_host_rule(const std::string& bind, std::uint16_t port,
                         const std::vector<std::string>& allowed) {
  host_rule r;
  r.port = port;
  r.names = {"localhost", "127.0.0.1", "::1"};
  auto add = [&](std::string n) {
    if (n == "*") r.any = true;
    if (!n.empty() && n != "0.0.0.0" && n != "::" &&
        std::find(r.names.begin(), r.names.end(), n) == r.names.end())
      r.names.push_back(std::move(n));
  };
  add(lower(unbracket(bind)));
  for (const auto& a : allowed) add(lower(unbracket(trim(a))));
  return r;
}

host_verdict check_host(const http_request& request, const host_rule& rule) {
  if (!request.has_host) {
    if (request.version == "HTTP/1.0") return {};
    return {400, "an HTTP/1.1 request needs a Host header"};
  }
  if (rule.any) return {};
  const std::string& h = request.host;
  std::string_view name = h, port;
  if (!h.empty() && h.front() == '[') {
    std::size_t close = h.find(']');
    if (close == std::string::npos) return {400, "Host '" + printable(h) + "' is not host[:port]"};
    name = std::string_view(h).substr(1, close - 1);
    std::string_view rest = std::string_view(h).substr(close + 1);
    if (!rest.empty() && rest.front() != ':')
      return {400, "Host '" + printable(h) + "' is not host[:port]"};
    if (!rest.empty()) port = rest.substr(1);
  } else if (std::size_t colon = h.rfind(':'); colon != std::string::npos) {
    name = std::string_view(h).substr(0, colon);
    port = std::string_view(h).substr(colon + 1);
  }
  if (name.empty() ||
      (!port.empty() && (port.size() > 5 || !std::all_of(port.begin(), port.end(), [](char c) {
                           return c >= '0' && c <= '9';
                         }))))
    return {400, "Host '" + printable(h) + "' is not host[:port]"};
  const std::string n = lower(name);
  const bool known = std::find(rule.names.begin(), rule.names.end(), n) != rule.names.end();
  const bool port_ok = port.empty() || std::stoul(std::string(port)) == rule.port;
  if (known && port_ok) return {};
  std::string allowed;
  for (const auto& a : rule.names)
    allowed +=
        (allowed.empty() ? "" : ", ") + (a.find(':') != std::string::npos ? "[" + a + "]" : a);
  return {403, "Host '" + printable(h) + "' is not allowed" +
                   (known ? " (port " + std::string(port) + " is not the server's " +
                                std::to_string(rule.port) + ")"
                          : "") +
                   "; this endpoint answers " + allowed + " on port " + std::to_string(rule.port) +
                   " (allow more names with troupe launch --introspection-hosts)"};
}

}  // namespace troupe::actors
