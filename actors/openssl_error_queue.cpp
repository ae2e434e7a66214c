// OpenSSL's error queue emptied before each TLS I/O call (openssl_error_queue.hpp says why).
#include "actors/openssl_error_queue.hpp"

#include <dlfcn.h>
#include <openssl/err.h>
#include <openssl/ssl.h>

namespace {

// OpenSSL's own definition of `name`: the next one after this executable's. Never null in a
// troupe executable, which links libssl itself (actors/tls.cpp); enable_tls checks it.
template <class F>
F openssl_next(const char* name) {
  return reinterpret_cast<F>(::dlsym(RTLD_NEXT, name));
}

using read_fn = int (*)(SSL*, void*, int);
using write_fn = int (*)(SSL*, const void*, int);
using step_fn = int (*)(SSL*);

}  // namespace

extern "C" {

int SSL_read(SSL* ssl, void* buf, int num) {
  static const read_fn next = openssl_next<read_fn>("SSL_read");
  ::ERR_clear_error();
  return next(ssl, buf, num);
}

int SSL_write(SSL* ssl, const void* buf, int num) {
  static const write_fn next = openssl_next<write_fn>("SSL_write");
  ::ERR_clear_error();
  return next(ssl, buf, num);
}

int SSL_accept(SSL* ssl) {
  static const step_fn next = openssl_next<step_fn>("SSL_accept");
  ::ERR_clear_error();
  return next(ssl);
}

int SSL_connect(SSL* ssl) {
  static const step_fn next = openssl_next<step_fn>("SSL_connect");
  ::ERR_clear_error();
  return next(ssl);
}

}  // extern "C"

namespace troupe::actors::detail {

bool openssl_error_queue_guarded() {
  const read_fn next = openssl_next<read_fn>("SSL_read");
  return next != nullptr && next != &SSL_read;
}

}  // namespace troupe::actors::detail
