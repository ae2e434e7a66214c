// The introspection HTTP endpoint (http_server.hpp) on Boost.Asio: one io_context on one thread,
// one request per connection ("Connection: close"), a bounded request head and a deadline per
// connection, so a slow or hostile client costs at most one socket for `timeout`.
#include <utility>  // before asio: Boost 1.74 uses std::exchange without it (C++20)

#include <boost/asio.hpp>

#include <atomic>
#include <exception>
#include <string_view>
#include <thread>

#include "actors/introspection/dashboard.hpp"
#include "actors/introspection/http_server.hpp"
#include "actors/introspection/render.hpp"
#include "memory/error.hpp"

namespace troupe::actors {
namespace {
namespace asio = boost::asio;
using tcp = asio::ip::tcp;

// Ends the request head: an empty line, "\r\n\r\n" or (from lax clients) "\n\n".
struct head_end {
  template <class It>
  std::pair<It, bool> operator()(It begin, It end) const {
    for (It i = begin; i != end; ++i) {
      if (*i != '\n') continue;
      It j = i;
      ++j;
      if (j != end && *j == '\r') ++j;
      if (j != end && *j == '\n') return {++j, true};
    }
    return {begin, false};  // search again from the start: heads are small
  }
};

}  // namespace
}  // namespace troupe::actors

template <>
struct boost::asio::is_match_condition<troupe::actors::head_end> : std::true_type {};

namespace troupe::actors {
namespace {

struct response {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
  bool allow_header = false;
};

const char* reason(int status) {
  switch (status) {
    case 200:
      return "OK";
    case 400:
      return "Bad Request";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 505:
      return "HTTP Version Not Supported";
  }
  return "Error";
}

std::string serialize(const response& r, bool head_only) {
  std::string out = "HTTP/1.1 " + std::to_string(r.status) + " " + reason(r.status) + "\r\n";
  out += "Content-Type: " + r.content_type + "\r\n";
  out += "Content-Length: " + std::to_string(r.body.size()) + "\r\n";
  if (r.allow_header) out += "Allow: GET, HEAD\r\n";
  out += "Cache-Control: no-store\r\nX-Content-Type-Options: nosniff\r\nConnection: close\r\n\r\n";
  if (!head_only) out += r.body;
  return out;
}

response error_response(int status, std::string message) {
  return {status, "text/plain; charset=utf-8", std::move(message) + "\n", false};
}

// The server's state; http_server::impl derives from it (connections cannot name the private
// http_server::impl).
struct server_state {
  // Declared before io: connections destroyed with io's pending handlers still count down.
  std::function<job_snapshot()> provider;
  http_server_limits limits;
  std::atomic<std::uint64_t> served{0};
  int open_connections = 0;  // touched on the server thread only
  std::uint16_t port = 0;
  std::string endpoint;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  std::thread thread;

  void accept();
  response answer(std::string_view head, bool& head_only);
};

class connection : public std::enable_shared_from_this<connection> {
 public:
  connection(server_state& server, tcp::socket socket)
      : server_(server),
        socket_(std::move(socket)),
        timer_(server.io),
        buf_(server.limits.max_header_bytes) {
    ++server_.open_connections;
  }
  ~connection() { --server_.open_connections; }

  void start() {
    arm_timer();
    asio::async_read_until(socket_, buf_, head_end{},
                           [self = shared_from_this()](boost::system::error_code ec,
                                                       std::size_t n) { self->on_head(ec, n); });
  }

 private:
  void on_head(boost::system::error_code ec, std::size_t n) {
    if (ec == asio::error::not_found) {  // the head filled the buffer without ending
      return send(serialize(
          error_response(431, "request head larger than " +
                                  std::to_string(server_.limits.max_header_bytes) + " bytes"),
          false));
    }
    if (ec) return close();  // closed, reset or timed out before a whole head came
    std::string_view head(static_cast<const char*>(buf_.data().data()), n);
    bool head_only = false;
    response r = server_.answer(head, head_only);
    send(serialize(r, head_only));
  }

  // (Re)starts the deadline: reading the head, then writing the answer, each get `timeout`, so a
  // slow provider does not eat the time of the write.
  void arm_timer() {
    timer_.expires_after(server_.limits.timeout);
    timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (!ec) self->close();
    });
  }

  void send(std::string bytes) {
    arm_timer();  // cancels the pending wait (its handler sees operation_aborted)
    out_ = std::move(bytes);
    asio::async_write(socket_, asio::buffer(out_),
                      [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                        self->server_.served.fetch_add(1, std::memory_order_relaxed);
                        if (ec) return self->close();
                        // Lingering close: stop sending, read what the client still sends until
                        // it closes, so unread request bytes do not turn our close into a reset
                        // that could destroy the response on its way.
                        boost::system::error_code ignored;
                        self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
                        self->drain();
                      });
  }

  void drain() {
    socket_.async_read_some(
        asio::buffer(scratch_),
        [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
          self->drained_ += n;
          if (ec || self->drained_ > (1u << 20)) return self->close();
          self->drain();
        });
  }

  void close() {
    boost::system::error_code ignored;
    timer_.cancel();
    socket_.close(ignored);
  }

  server_state& server_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  asio::streambuf buf_;
  std::string out_;
  std::array<char, 4096> scratch_{};
  std::size_t drained_ = 0;
};

void server_state::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) {
      if (open_connections >= limits.max_connections) {
        boost::system::error_code ignored;
        socket.close(ignored);  // too many clients at once: refuse this one
      } else {
        std::make_shared<connection>(*this, std::move(socket))->start();
      }
    }
    accept();  // errors such as EMFILE are per connection: keep accepting
  });
}

response server_state::answer(std::string_view head, bool& head_only) {
  std::size_t eol = head.find('\n');
  std::string_view line = head.substr(0, eol);
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  std::size_t sp1 = line.find(' ');
  std::size_t sp2 = sp1 == std::string_view::npos ? sp1 : line.find(' ', sp1 + 1);
  if (sp1 == 0 || sp2 == std::string_view::npos || line.find(' ', sp2 + 1) != line.npos)
    return error_response(400, "malformed request line");
  std::string_view method = line.substr(0, sp1), target = line.substr(sp1 + 1, sp2 - sp1 - 1),
                   version = line.substr(sp2 + 1);
  if (version.substr(0, 5) != "HTTP/" || target.empty())
    return error_response(400, "malformed request line");
  if (version != "HTTP/1.1" && version != "HTTP/1.0")
    return error_response(505, "only HTTP/1.0 and HTTP/1.1 are served");
  if (method != "GET" && method != "HEAD") {
    response r = error_response(405, "read-only endpoint: only GET and HEAD are allowed");
    r.allow_header = true;
    return r;
  }
  head_only = method == "HEAD";
  if (target.substr(0, 7) == "http://") {  // absolute form: keep the path
    std::size_t slash = target.find('/', 7);
    target = slash == target.npos ? "/" : target.substr(slash);
  }
  std::string_view path = target.substr(0, target.find_first_of("?#"));

  if (path == "/healthz") return {200, "text/plain; charset=utf-8", "ok\n", false};
  if (path == "/") return {200, "text/html; charset=utf-8", std::string(dashboard_html()), false};
  if (path != "/table" && path != "/json" && path != "/metrics")
    return error_response(404, "no such page; try /, /table, /json, /metrics or /healthz");
  try {
    job_snapshot s = provider();
    if (path == "/json") return {200, "application/json", to_json(s) + "\n", false};
    if (path == "/metrics")
      return {200, "text/plain; version=0.0.4; charset=utf-8", to_prometheus(s), false};
    return {200, "text/html; charset=utf-8", render_html(s), false};
  } catch (const std::exception& e) {
    return error_response(500, std::string("snapshot failed: ") + e.what());
  } catch (...) {
    return error_response(500, "snapshot failed: unknown exception");
  }
}

}  // namespace

struct http_server::impl : server_state {};

http_server::http_server(std::function<job_snapshot()> provider, std::string bind,
                         std::uint16_t port)
    : http_server(std::move(provider), std::move(bind), port, http_server_limits{}) {}

http_server::http_server(std::function<job_snapshot()> provider, std::string bind,
                         std::uint16_t port, http_server_limits limits)
    : impl_(std::make_unique<impl>()) {
  TROUPE_CHECK(provider, "introspection http server: no snapshot provider given");
  TROUPE_CHECK(
      limits.max_header_bytes >= 64 && limits.timeout.count() > 0 && limits.max_connections > 0,
      "introspection http server: limits out of range");
  impl_->provider = std::move(provider);
  impl_->limits = limits;
  std::string where = bind + ":" + std::to_string(port);
  boost::system::error_code ec;
  tcp::resolver resolver(impl_->io);
  auto found = resolver.resolve(bind, std::to_string(port),
                                tcp::resolver::passive | tcp::resolver::numeric_service, ec);
  if (ec || found.empty())
    TROUPE_FAIL("introspection http server: cannot resolve bind address ", where, ": ",
                ec ? ec.message() : "no address");
  tcp::endpoint ep = found.begin()->endpoint();
  auto& a = impl_->acceptor;
  if (a.open(ep.protocol(), ec) || a.set_option(tcp::acceptor::reuse_address(true), ec) ||
      a.bind(ep, ec) || a.listen(asio::socket_base::max_listen_connections, ec))
    TROUPE_FAIL("introspection http server: cannot listen on ", where, ": ", ec.message());
  tcp::endpoint local = a.local_endpoint(ec);
  if (ec) TROUPE_FAIL("introspection http server: local address of ", where, ": ", ec.message());
  impl_->port = local.port();
  std::string host = local.address().to_string();
  impl_->endpoint =
      (local.address().is_v6() ? "[" + host + "]" : host) + ":" + std::to_string(impl_->port);
  impl_->accept();
  impl_->thread = std::thread([im = impl_.get()] {
    for (;;) {
      try {
        im->io.run();
        return;
      } catch (...) {
        // A handler threw (they catch what they expect): drop it and keep serving.
      }
    }
  });
}

http_server::~http_server() {
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
  boost::system::error_code ignored;
  impl_->acceptor.close(ignored);
}

std::uint16_t http_server::port() const {
  return impl_->port;
}
std::string http_server::endpoint() const {
  return impl_->endpoint;
}
std::uint64_t http_server::requests_served() const {
  return impl_->served.load(std::memory_order_relaxed);
}

}  // namespace troupe::actors
