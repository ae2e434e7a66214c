#include "actors/openssl_error_queue.hpp"

#include <fcntl.h>
#include <openssl/err.h>
#include <openssl/ssl.h>
#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <string>

using namespace troupe::actors;

// The failure CAF's openssl module met (openssl_error_queue.hpp): an error left on the thread by
// an earlier failed handshake made the next "no full record yet" read look fatal.
namespace {

// A TLS 1.2 context with anonymous ECDH (no certificates needed: what CAF's openssl module uses
// without authentication).
SSL_CTX* anonymous_context(const SSL_METHOD* method) {
  SSL_CTX* ctx = ::SSL_CTX_new(method);
  if (ctx == nullptr) return nullptr;
  ::SSL_CTX_set_max_proto_version(ctx, TLS1_2_VERSION);
  ::SSL_CTX_set_security_level(ctx, 0);
  ::SSL_CTX_set_cipher_list(ctx, "aNULL");
  return ctx;
}

}  // namespace

TEST_CASE("A stale OpenSSL error on a thread does not make the next TLS read fail",
          "[actors][tls]") {
  REQUIRE(detail::openssl_error_queue_guarded());
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  for (int fd : fds) REQUIRE(::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK) == 0);
  SSL_CTX* client_ctx = anonymous_context(TLS_client_method());
  SSL_CTX* server_ctx = anonymous_context(TLS_server_method());
  REQUIRE(client_ctx != nullptr);
  REQUIRE(server_ctx != nullptr);
  SSL* client = ::SSL_new(client_ctx);
  SSL* server = ::SSL_new(server_ctx);
  REQUIRE(client != nullptr);
  REQUIRE(server != nullptr);
  REQUIRE(::SSL_set_fd(client, fds[0]) == 1);
  REQUIRE(::SSL_set_fd(server, fds[1]) == 1);
  ::SSL_set_connect_state(client);
  ::SSL_set_accept_state(server);
  // The handshake, both ends in turn on this thread (each step returns "try again" until the
  // other end has answered).
  bool client_done = false, server_done = false;
  for (int turn = 0; turn < 100 && !(client_done && server_done); ++turn) {
    if (!client_done) {
      const int r = ::SSL_do_handshake(client);
      client_done = r == 1;
      if (!client_done) REQUIRE(::SSL_get_error(client, r) == SSL_ERROR_WANT_READ);
    }
    if (!server_done) {
      const int r = ::SSL_do_handshake(server);
      server_done = r == 1;
      if (!server_done) REQUIRE(::SSL_get_error(server, r) == SSL_ERROR_WANT_READ);
    }
  }
  REQUIRE(client_done);
  REQUIRE(server_done);

  // What a refused peer's handshake leaves behind on the multiplexer thread.
  ERR_raise(ERR_LIB_SSL, SSL_R_WRONG_VERSION_NUMBER);
  REQUIRE(::ERR_peek_error() != 0);
  char buf[16];
  // Nothing sent yet: "try again", not an error.
  const int r = ::SSL_read(client, buf, sizeof buf);
  CHECK(r <= 0);
  CHECK(::SSL_get_error(client, r) == SSL_ERROR_WANT_READ);
  // The connection works both ways.
  CHECK(::SSL_write(server, "ping", 4) == 4);
  CHECK(::SSL_read(client, buf, sizeof buf) == 4);
  CHECK(std::string(buf, 4) == "ping");

  ::SSL_free(client);
  ::SSL_free(server);
  ::SSL_CTX_free(client_ctx);
  ::SSL_CTX_free(server_ctx);
  ::close(fds[0]);
  ::close(fds[1]);
}
