// TLS settings: their checks with OpenSSL, before CAF's openssl module sees them (it would only
// fail each handshake, or prompt on the terminal for an encrypted key's passphrase).
#include "actors/tls.hpp"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "memory/error.hpp"

namespace troupe::actors {
namespace {

std::string openssl_errors() {
  std::string msg;
  while (unsigned long e = ERR_get_error()) {
    char buf[256];
    ERR_error_string_n(e, buf, sizeof buf);
    if (!msg.empty()) msg += "; ";
    msg += buf;
  }
  return msg.empty() ? std::string("no detail from OpenSSL") : msg;
}

// Refuses to read an encrypted key instead of asking on the terminal.
int no_passphrase(char*, int, int, void*) {
  return 0;
}

std::string absolute(const std::string& p) {
  if (p.empty() || p.front() == '/') return p;
  char* cwd = ::getcwd(nullptr, 0);
  if (cwd == nullptr) return p;
  std::string out = std::string(cwd) + "/" + p;
  std::free(cwd);
  return out;
}

}  // namespace

bool tls_supported() {
#ifdef TROUPE_HAVE_CAF_OPENSSL
  return true;
#else
  return false;
#endif
}

tls_options absolute_tls_paths(tls_options tls) {
  tls.cert = absolute(tls.cert);
  tls.key = absolute(tls.key);
  tls.ca = absolute(tls.ca);
  return tls;
}

void check_tls(const tls_options& t, tls_source source) {
  const bool flags = source == tls_source::flags;
  const std::string on = flags ? "--tls" : "TLS (TROUPE_TLS_CERT)";
  const std::string cert = flags ? "--tls-cert" : "TROUPE_TLS_CERT";
  const std::string key = flags ? "--tls-key" : "TROUPE_TLS_KEY";
  const std::string ca = flags ? "--tls-ca" : "TROUPE_TLS_CA";
  TROUPE_CHECK(tls_supported(), on,
               ": this troupe was built without CAF's openssl module (libcaf_openssl, Debian "
               "package libcaf-openssl0.17 with libcaf-dev): TLS is not available");
  TROUPE_CHECK(!t.cert.empty() && !t.key.empty(), on, " needs ", cert, " FILE and ", key,
               " FILE (missing: ", t.cert.empty() ? cert : key, ")");
  auto readable = [](const std::string& what, const std::string& path) {
    TROUPE_CHECK(::access(path.c_str(), R_OK) == 0, what, " ", path,
                 ": cannot read it: ", std::strerror(errno));
  };
  readable(cert, t.cert);
  readable(key, t.key);
  if (!t.ca.empty()) readable(ca, t.ca);

  ERR_clear_error();
  std::unique_ptr<SSL_CTX, decltype(&SSL_CTX_free)> ctx(SSL_CTX_new(TLS_method()), SSL_CTX_free);
  TROUPE_CHECK(ctx, "TLS: cannot create an OpenSSL context: ", openssl_errors());
  SSL_CTX_set_default_passwd_cb(ctx.get(), no_passphrase);
  if (SSL_CTX_use_certificate_chain_file(ctx.get(), t.cert.c_str()) != 1)
    TROUPE_FAIL(cert, " ", t.cert, ": not a usable PEM certificate: ", openssl_errors());
  // Read apart from the certificate, so that a key of another certificate is named as such.
  std::unique_ptr<BIO, decltype(&BIO_free)> kb(BIO_new_file(t.key.c_str(), "r"), BIO_free);
  std::unique_ptr<EVP_PKEY, decltype(&EVP_PKEY_free)> pkey(
      kb ? PEM_read_bio_PrivateKey(kb.get(), nullptr, no_passphrase, nullptr) : nullptr,
      EVP_PKEY_free);
  if (!pkey)
    TROUPE_FAIL(key, " ", t.key,
                ": not a usable unencrypted PEM private key (passphrases are not supported): ",
                openssl_errors());
  if (SSL_CTX_use_PrivateKey(ctx.get(), pkey.get()) != 1 ||
      SSL_CTX_check_private_key(ctx.get()) != 1)
    TROUPE_FAIL(key, " ", t.key, " does not match the certificate of ", cert, " ", t.cert, ": ",
                openssl_errors());
  const std::string& ca_file = t.ca_file();
  const std::string ca_name = t.ca.empty() ? cert + " (the CA when " + ca + " is not given)" : ca;
  if (SSL_CTX_load_verify_locations(ctx.get(), ca_file.c_str(), nullptr) != 1)
    TROUPE_FAIL(ca_name, " ", ca_file, ": no usable PEM CA certificate: ", openssl_errors());

  // Peers check this certificate against the same CA: it must chain to it.
  X509* leaf = SSL_CTX_get0_certificate(ctx.get());
  STACK_OF(X509)* chain = nullptr;
  SSL_CTX_get0_chain_certs(ctx.get(), &chain);
  std::unique_ptr<X509_STORE_CTX, decltype(&X509_STORE_CTX_free)> vctx(X509_STORE_CTX_new(),
                                                                       X509_STORE_CTX_free);
  TROUPE_CHECK(
      vctx && X509_STORE_CTX_init(vctx.get(), SSL_CTX_get_cert_store(ctx.get()), leaf, chain) == 1,
      "TLS: cannot set up certificate verification: ", openssl_errors());
  if (X509_verify_cert(vctx.get()) != 1)
    TROUPE_FAIL(cert, " ", t.cert, " does not verify against ", ca_name, " ", ca_file, ": ",
                X509_verify_cert_error_string(X509_STORE_CTX_get_error(vctx.get())));
}

}  // namespace troupe::actors
