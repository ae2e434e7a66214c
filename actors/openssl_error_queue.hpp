// OpenSSL's error queue kept clean before every TLS read, write and handshake step of this process.
//
// OpenSSL keeps errors in a per-thread queue, and SSL_get_error() reports SSL_ERROR_SSL when that
// queue is not empty, whatever the call it is asked about did; its manual requires the queue to be
// empty before each I/O call. CAF 0.17's openssl module (the control plane under --tls) never
// empties it: after one failed handshake (a peer without TLS, or with a certificate the job does
// not trust), the next SSL_read on the multiplexer thread that has no full record yet (an ordinary
// "try again") was taken for a fatal error, and CAF closed that connection - a rank that had
// joined well was lost (`remote_link_unreachable`) about one time in fifteen.
//
// openssl_error_queue.cpp defines SSL_read, SSL_write, SSL_accept and SSL_connect in this
// executable: each empties the calling thread's queue and calls OpenSSL's own (the dynamic linker
// binds libcaf_openssl's calls to the executable's definitions first). Errors of a call are still
// in the queue right after it, for SSL_get_error and for whoever reads them.
#pragma once

namespace troupe::actors::detail {

// True: the four definitions are linked into this executable (calling it is what links them).
bool openssl_error_queue_guarded();

}  // namespace troupe::actors::detail
