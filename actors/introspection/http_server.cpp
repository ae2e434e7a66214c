// The introspection HTTP endpoint (http_server.hpp) on Boost.Asio: one io_context on one thread,
// one request per connection ("Connection: close"), a bounded request head, a deadline per
// connection and a cap on open connections that closes the oldest unfinished head first, so a
// slow or hostile client costs at most one socket for `timeout`. Snapshot pages come ready from
// the snapshot_cache's thread.
#include <utility>  // before asio: Boost 1.74 uses std::exchange without it (C++20)

#include <boost/asio.hpp>

#include <array>
#include <atomic>
#include <cerrno>
#include <list>
#include <string_view>
#include <thread>

#include "actors/introspection/dashboard.hpp"
#include "actors/introspection/http_request.hpp"
#include "actors/introspection/http_server.hpp"
#include "actors/introspection/render.hpp"
#include "actors/introspection/snapshot_cache.hpp"
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

// The pages. A snapshot page is rendered by the snapshot_cache from each snapshot; a fixed page
// is constant. Every page answers GET and HEAD only. To add a page, add a line here.
std::vector<snapshot_view> snapshot_pages() {
  return {
      {"/table", "text/html; charset=utf-8", [](const job_snapshot& s) { return render_html(s); }},
      {"/json", "application/json", [](const job_snapshot& s) { return to_json(s) + "\n"; }},
      {"/metrics", "text/plain; version=0.0.4; charset=utf-8",
       [](const job_snapshot& s) { return to_prometheus(s); }},
  };
}

struct fixed_page {
  std::string path;
  std::string content_type;
  std::string body;
};

std::vector<fixed_page> fixed_pages() {
  return {
      {"/", "text/html; charset=utf-8", std::string(dashboard_html())},
      {"/healthz", "text/plain; charset=utf-8", "ok\n"},
  };
}

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
    case 403:
      return "Forbidden";
    case 404:
      return "Not Found";
    case 405:
      return "Method Not Allowed";
    case 408:
      return "Request Timeout";
    case 431:
      return "Request Header Fields Too Large";
    case 500:
      return "Internal Server Error";
    case 503:
      return "Service Unavailable";
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

class connection;

// The server's state; http_server::impl derives from it (connections cannot name the private
// http_server::impl).
struct server_state {
  // Declared before io: connections destroyed with io's pending handlers still count down.
  http_server_limits limits;
  host_rule hosts;
  std::vector<fixed_page> fixed = fixed_pages();
  std::unique_ptr<snapshot_cache> cache;
  std::atomic<std::uint64_t> served{0};
  std::atomic<int> open{0};     // connections not yet closed
  std::list<connection*> live;  // those, oldest first (server thread only)
  std::uint16_t port = 0;
  std::string endpoint;
  asio::io_context io;
  tcp::acceptor acceptor{io};
  asio::steady_timer accept_pause{io};
  std::thread thread;

  void accept();
  bool make_room();
  std::string paths() const;
};

class connection : public std::enable_shared_from_this<connection> {
 public:
  enum class phase { reading, waiting, writing, draining, closed };

  connection(server_state& server, tcp::socket socket)
      : server_(server),
        socket_(std::move(socket)),
        timer_(server.io),
        buf_(server.limits.max_header_bytes) {
    ++server_.open;
    at_ = server_.live.insert(server_.live.end(), this);
  }
  ~connection() { close(); }

  phase state() const { return phase_; }

  void start() {
    arm_timer();
    asio::async_read_until(socket_, buf_, head_end{},
                           [self = shared_from_this()](boost::system::error_code ec,
                                                       std::size_t n) { self->on_head(ec, n); });
  }

  // Closes this connection to make room for a new one; a client still sending its head is told
  // why (best effort: one non-blocking write of a short answer).
  void evict() {
    if (phase_ == phase::reading) {
      std::string bytes = serialize(
          error_response(503, "closed to make room for a new client: " +
                                  std::to_string(server_.limits.max_connections) +
                                  " connections were open (the limit) and this one had not sent "
                                  "a whole request head"),
          false);
      boost::system::error_code ignored;
      socket_.non_blocking(true, ignored);
      if (!ignored) socket_.write_some(asio::buffer(bytes), ignored);
    }
    close();
  }

  void close() {
    if (phase_ == phase::closed) return;
    phase_ = phase::closed;
    --server_.open;
    server_.live.erase(at_);
    boost::system::error_code ignored;
    timer_.cancel();
    socket_.close(ignored);
  }

 private:
  void on_head(boost::system::error_code ec, std::size_t n) {
    if (phase_ != phase::reading) return;  // answered or closed meanwhile
    if (ec == asio::error::not_found) {    // the head filled the buffer without ending
      return answer(
          error_response(431, "request head larger than " +
                                  std::to_string(server_.limits.max_header_bytes) + " bytes"),
          false);
    }
    if (ec) return close();  // closed or reset before a whole head came
    std::string_view head(static_cast<const char*>(buf_.data().data()), n);
    parsed_request p = parse_request_head(head);
    if (p.status != 0) return answer(error_response(p.status, p.error), false);
    const http_request& rq = p.request;
    host_verdict host = check_host(rq, server_.hosts);
    if (host.status != 0) return answer(error_response(host.status, host.error), false);
    if (rq.method != "GET" && rq.method != "HEAD") {
      response r = error_response(405, "read-only endpoint: only GET and HEAD are allowed");
      r.allow_header = true;
      return answer(r, false);
    }
    const bool head_only = rq.method == "HEAD";
    for (const auto& f : server_.fixed)
      if (rq.path == f.path) return answer({200, f.content_type, f.body, false}, head_only);
    for (const auto& v : server_.cache->views())
      if (rq.path == v.path) return wait_for_snapshot(v, head_only);
    answer(error_response(404, "no such page; try " + server_.paths()), false);
  }

  // Parks this connection (no deadline: the provider has its own) until the cache has a fresh
  // enough snapshot; the answer is then written on the server thread.
  void wait_for_snapshot(const snapshot_view& view, bool head_only) {
    phase_ = phase::waiting;
    timer_.cancel();
    server_.cache->get(
        snapshot_cache::clock::now(), [self = shared_from_this(), view = &view, head_only](
                                          std::shared_ptr<const rendered_snapshot> snap) mutable {
          // Hand our reference to the server thread: the connection must not die here.
          asio::io_context& io = self->server_.io;
          asio::post(io, [self = std::move(self), snap = std::move(snap), view, head_only] {
            if (self->phase_ != phase::waiting) return;
            if (!snap->error.empty())
              return self->answer(error_response(500, "snapshot failed: " + snap->error), false);
            auto it = snap->bodies.find(view->path);
            if (it == snap->bodies.end())
              return self->answer(error_response(500, "snapshot has no " + view->path), false);
            self->answer({200, view->content_type, it->second, false}, head_only);
          });
        });
  }

  // (Re)starts the deadline of the phase at hand: reading the head (then a 408), writing the
  // answer or draining (then a close).
  void arm_timer() {
    timer_.expires_after(server_.limits.timeout);
    timer_.async_wait([self = shared_from_this()](boost::system::error_code ec) {
      if (ec) return;  // cancelled
      if (self->phase_ == phase::reading)
        return self->answer(
            error_response(408, "no complete request head within " +
                                    std::to_string(self->server_.limits.timeout.count()) + " ms"),
            false);
      self->close();
    });
  }

  void answer(const response& r, bool head_only) {
    if (phase_ == phase::closed) return;
    phase_ = phase::writing;
    boost::system::error_code ignored;
    socket_.cancel(ignored);  // a pending head read ends (its handler sees phase writing)
    arm_timer();              // cancels the pending wait (its handler sees operation_aborted)
    out_ = serialize(r, head_only);
    asio::async_write(socket_, asio::buffer(out_),
                      [self = shared_from_this()](boost::system::error_code ec, std::size_t) {
                        if (self->phase_ != phase::writing) return;  // closed meanwhile
                        self->server_.served.fetch_add(1, std::memory_order_relaxed);
                        if (ec) return self->close();
                        // Lingering close: stop sending, read what the client still sends until
                        // it closes, so unread request bytes do not turn our close into a reset
                        // that could destroy the response on its way.
                        self->phase_ = phase::draining;
                        boost::system::error_code ignored;
                        self->socket_.shutdown(tcp::socket::shutdown_send, ignored);
                        self->drain();
                      });
  }

  void drain() {
    socket_.async_read_some(
        asio::buffer(scratch_),
        [self = shared_from_this()](boost::system::error_code ec, std::size_t n) {
          if (self->phase_ != phase::draining) return;
          self->drained_ += n;
          if (ec || self->drained_ > (1u << 20)) return self->close();
          self->drain();
        });
  }

  server_state& server_;
  tcp::socket socket_;
  asio::steady_timer timer_;
  asio::streambuf buf_;
  std::string out_;
  std::array<char, 4096> scratch_{};
  std::size_t drained_ = 0;
  phase phase_ = phase::reading;
  std::list<connection*>::iterator at_;
};

// Closes one connection to make room: the oldest that has its answer already (draining), else
// the oldest still sending its head. Connections waiting for or taking an answer are kept.
bool server_state::make_room() {
  for (auto want : {connection::phase::draining, connection::phase::reading})
    for (connection* c : live)
      if (c->state() == want) {
        c->evict();
        return true;
      }
  return false;
}

void server_state::accept() {
  acceptor.async_accept([this](boost::system::error_code ec, tcp::socket socket) {
    if (ec == asio::error::operation_aborted || !acceptor.is_open()) return;
    if (!ec) {
      if (open.load() >= limits.max_connections && !make_room()) {
        // Every open connection is a request in progress: refuse this one, saying why.
        std::string bytes =
            serialize(error_response(503, std::to_string(open.load()) +
                                              " requests are in progress (the limit); try again"),
                      false);
        boost::system::error_code ignored;
        socket.non_blocking(true, ignored);
        if (!ignored) socket.write_some(asio::buffer(bytes), ignored);
        socket.close(ignored);
      } else {
        std::make_shared<connection>(*this, std::move(socket))->start();
      }
    } else if (ec == asio::error::no_descriptors || ec == asio::error::no_buffer_space ||
               ec == asio::error::no_memory || ec.value() == ENFILE) {
      // Out of file descriptors: free one, or pause instead of spinning on the listen socket.
      if (!make_room()) {
        accept_pause.expires_after(std::chrono::milliseconds(100));
        accept_pause.async_wait([this](boost::system::error_code e) {
          if (!e) accept();
        });
        return;
      }
    }
    accept();  // other errors are per connection: keep accepting
  });
}

std::string server_state::paths() const {
  std::string out;
  for (const auto& v : cache->views()) out += (out.empty() ? "" : ", ") + v.path;
  for (const auto& f : fixed) out += ", " + f.path;
  return out;
}

}  // namespace

struct http_server::impl : server_state {};

http_server::http_server(std::function<job_snapshot()> provider, std::string bind,
                         std::uint16_t port)
    : http_server(std::move(provider), std::move(bind), port, http_server_limits{}) {}

http_server::http_server(std::function<job_snapshot()> provider, std::string bind,
                         std::uint16_t port, http_server_limits limits)
    : http_server(std::move(provider), http_server_options{std::move(bind), port, {}, limits}) {}

http_server::http_server(std::function<job_snapshot()> provider, http_server_options options)
    : impl_(std::make_unique<impl>()) {
  const http_server_limits& limits = options.limits;
  TROUPE_CHECK(provider, "introspection http server: no snapshot provider given");
  TROUPE_CHECK(limits.max_header_bytes >= 64 && limits.timeout.count() > 0 &&
                   limits.max_connections > 0 && limits.snapshot_max_age.count() >= 0,
               "introspection http server: limits out of range");
  impl_->limits = limits;
  const std::string& bind = options.bind;
  const std::uint16_t port = options.port;
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
  impl_->hosts = make_host_rule(bind, impl_->port, options.allowed_hosts);
  impl_->cache = std::make_unique<snapshot_cache>(std::move(provider), snapshot_pages(),
                                                  limits.snapshot_max_age);
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
  // The server thread is gone: readers the cache still holds are dropped here, and its late
  // answers only queue on the stopped io_context.
  impl_->cache->stop();
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
std::uint64_t http_server::snapshots_built() const {
  return impl_->cache->builds();
}
int http_server::open_connections() const {
  return impl_->open.load();
}

}  // namespace troupe::actors
