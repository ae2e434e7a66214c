// The UCX transport: point-to-point byte transfers between the processes of one job.
//
// One ucp context and ONE worker per process (UCS_THREAD_MODE_MULTI: any thread may post, test,
// wait and progress). Messages are ucp tag messages; the UCX tag is (sender world rank << 48) |
// user tag and receives match sender and tag exactly. Large messages go by rendezvous straight into
// the posted receive buffer (no staging copy on the receiving side beyond the shared-memory
// fragments).
//
// Progress: whoever waits progresses the worker (spin, then yield, then sleep); a background thread
// blocked on the worker's event fd progresses rendezvous transfers when nobody waits.
//
// Setup: make the transport, send address() to every peer by any side channel (CAF message, socket,
// local_ranks), then connect(peer, address) for every peer. Both sides must connect before data
// flows in both directions. The UCX headers stay in the .cpp (actors/ includes this header).
//
// Authentication: every endpoint proves job membership before data moves (collective/ucx/README.md,
// "Authentication"). On connect(k) this rank sends k a hello carrying a fresh nonce (its
// challenge) and an HMAC-SHA256 keyed by the job token; k answers with a proof over that nonce,
// sent on k's own endpoint to the address the membership layer registered for this rank, so only
// the process at that address can answer. Both nonces key the pair's session; the user tag of
// every data message is XORed with a 48-bit pad derived from it, so a message from a process that
// did not complete the handshake (no token, or a member posing as another rank) matches no
// receive. The token never crosses the wire. Refused handshakes are counted and logged, naming
// the rank claimed.
//
// Failure: fail_peer(k) completes every pending request with k as failed ("rank k lost: ...") and
// fails later ones immediately; an endpoint error reported by UCX does the same. Destruction never
// waits for peers: endpoints are force-closed (a peer may be dead), so destroy a transport only
// after the application knows its last messages were received (e.g. after a barrier).
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "collective/transport.hpp"

namespace troupe::collective {

// Which endpoints ask UCX for peer-failure reports (UCP_ERR_HANDLING_MODE_PEER).
//
// UCX 1.13's shared-memory transports (sysv, posix, cma) cannot report a failed peer, so an
// endpoint in PEER mode to a rank on the same host runs over tcp loopback instead, at a fraction
// of the bandwidth (see README.md). `automatic` uses PEER mode for ranks on other hosts and no
// error handling for ranks on this host: the membership layer's fail_peer is their failure
// detector (a dead local process is noticed by its supervisor, not by UCX).
//
// Only `peer` lets survivors go on talking after a local rank is killed: each shared-memory
// receiver has one FIFO that every sender reserves slots in, so a rank killed between reserving a
// slot and publishing it stalls that receiver for all senders (seen here as a hang in about one of
// ten SIGKILLs during a 64 MiB allreduce; tcp endpoints isolate the dead peer). With `automatic`,
// after a local loss, tear the job down or give every operation a timeout.
enum class ucx_error_mode { automatic, peer, none };

struct ucx_transport_options {
  int rank = 0;
  int size = 1;
  // UCX_NET_DEVICES for the tcp transport (cross-host traffic) unless the environment sets it.
  std::string net_device = "lo";
  // A background thread that progresses the worker when no thread waits (event fd, no spinning).
  bool progress_thread = true;
  ucx_error_mode error_mode = ucx_error_mode::automatic;
  // Large messages between local ranks by cma (one copy, by the receiver) where the kernel allows
  // it; false: by shared-memory fragments (two copies, one on each side). Ignored when UCX_TLS is
  // set. One copy wins whenever both sides are busy (every collective: 1.5-2x at 16-256 MiB
  // allreduce); fragments win a one-way stream of single messages of tens of MiB, where sender and
  // receiver copy in parallel (collective/ucx/README.md).
  bool single_copy = true;
  // The job token every endpoint proves it holds (required; it never crosses the wire) and the
  // job's name, bound into every proof.
  std::string token;
  std::string job;
  // How long isend/irecv with a peer whose handshake has not finished wait for it (connect() sends
  // the hello; authenticate() waits for every connected peer).
  std::chrono::milliseconds handshake_timeout{60000};
};

class ucx_transport : public transport {
 public:
  // Creates the ucp context and worker. Honours every UCX_* environment variable; where the user
  // sets none, UCX_TLS defaults to shared memory (and cma, see single_copy) for local peers and tcp
  // for remote ones, and UCX_MAX_RNDV_RAILS to 1 with cma (its rail), else 0 (rendezvous through
  // the shared-memory fragments, never tcp loopback; collective/ucx/README.md has the numbers).
  explicit ucx_transport(ucx_transport_options options);
  ~ucx_transport() override;
  ucx_transport(const ucx_transport&) = delete;
  ucx_transport& operator=(const ucx_transport&) = delete;

  // This rank's address (the UCX worker address plus an identity of this host), to be handed to
  // every peer's connect(). Opaque: pass it on byte for byte.
  std::vector<std::uint8_t> address() const;
  // Creates the endpoint to `peer` from its worker address. Connecting a peer declared lost
  // replaces its endpoint and clears its failure (a re-joined rank).
  void connect(int peer, std::span<const std::uint8_t> address);
  bool connected(int peer) const;
  // Blocks until every connected peer has proven job membership, progressing the worker; throws
  // troupe::error naming the ranks still unproven when `timeout` passes. Peers must connect back.
  void authenticate(std::chrono::milliseconds timeout);
  // Whether `peer` proved membership on its current endpoint.
  bool authenticated(int peer) const;
  // Handshake messages refused so far (wrong token, a rank posing as another, malformed), and
  // their log lines ("rank 0 refused a UCX peer claiming rank 1: ..."), oldest first.
  std::uint64_t refused() const;
  std::vector<std::string> refusals() const;
  // Blocks until at least `count` handshakes were refused or `timeout` passes; returns whether.
  bool await_refusals(std::uint64_t count, std::chrono::milliseconds timeout) const;
  // Handshake messages held until connect() gives their sender's address (a peer that said hello
  // first, or a lost rank's replacement before this rank learns its address), counted since the
  // start; and a wait for at least `count` of them.
  std::uint64_t held_handshakes() const;
  bool await_held_handshakes(std::uint64_t count, std::chrono::milliseconds timeout) const;

  int rank() const override;
  int size() const override;
  p2p_request isend(int peer, std::uint64_t tag, const void* data, std::size_t bytes) override;
  p2p_request irecv(int peer, std::uint64_t tag, void* data, std::size_t bytes) override;
  bool test(p2p_request& r) override;
  void wait(p2p_request& r,
            std::chrono::milliseconds timeout = std::chrono::milliseconds{0}) override;
  void fail_peer(int peer, const std::string& reason) override;
  std::string peer_failure(int peer) const override;
  // True once connect(peer) was given an address carrying this host's identity.
  bool same_host(int peer) const override;
  std::uint64_t bytes_sent() const override;
  std::uint64_t bytes_received() const override;

  // The UCX settings in effect (UCX_TLS, UCX_MAX_RNDV_RAILS), for logs and benchmarks.
  std::string transports() const;
  // Whether the endpoint to `peer` asks UCX for failure reports (false before connect()).
  bool peer_error_handling(int peer) const;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::collective
