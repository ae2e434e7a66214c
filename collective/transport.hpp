// The point-to-point transport the collective algorithms run on.
//
// A transport connects the ranks of one job (its "world") and moves bytes between them: post a send
// or a receive of a byte range with a 48-bit tag, get a request, wait for it. The bytes are never
// copied into a message: the buffer must stay alive and untouched until the request completes.
// Messages between one pair of ranks with the same tag are matched in the order they were posted
// (as in MPI), so a fixed schedule can reuse a tag.
//
// Two implementations: collective/ucx (processes, UCX over shared memory or TCP) and
// collective/local (ranks as threads of one process, for fast tests). The membership layer
// (actors/) calls fail_peer when a rank is lost: every pending and later request with that rank
// fails with an error naming it, so nothing waits forever on a dead peer.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace troupe::collective {

// The largest user tag a transport accepts (48 bits; the rest identifies the sender). Bit 47 is
// reserved for actors/ tensor transfers: collectives use tags with bit 47 clear.
inline constexpr std::uint64_t max_tag = (std::uint64_t{1} << 48) - 1;

namespace detail {
// The state every transport's requests share; transports derive their own request types from it.
struct p2p_state {
  virtual ~p2p_state() = default;
  enum : int { pending = 0, done = 1, failed = 2 };
  std::atomic<int> status{pending};
  std::string error;  // written before status becomes `failed`
  int peer = -1;
  std::uint64_t tag = 0;
  std::size_t bytes = 0;
  bool is_send = false;
};
}  // namespace detail

// One posted send or receive. Cheap to move; completion is observed through the transport.
class p2p_request {
 public:
  p2p_request() = default;
  explicit p2p_request(std::shared_ptr<detail::p2p_state> s) : state_(std::move(s)) {}
  bool valid() const { return state_ != nullptr; }
  detail::p2p_state* state() const { return state_.get(); }

 private:
  std::shared_ptr<detail::p2p_state> state_;
};

class transport {
 public:
  virtual ~transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // Posts a send of `bytes` bytes at `data` to `peer` (a world rank other than rank()).
  virtual p2p_request isend(int peer, std::uint64_t tag, const void* data, std::size_t bytes) = 0;
  // Posts a receive of exactly `bytes` bytes from `peer` into `data`. A message of another size is
  // an error naming both sizes.
  virtual p2p_request irecv(int peer, std::uint64_t tag, void* data, std::size_t bytes) = 0;

  // True once the request has finished; throws troupe::error if it failed.
  virtual bool test(p2p_request& r) = 0;
  // Blocks until the request finishes; throws troupe::error if it failed (peer lost, size mismatch)
  // or if `timeout` (0 = none) passes first, naming the peer and the tag.
  virtual void wait(p2p_request& r,
                    std::chrono::milliseconds timeout = std::chrono::milliseconds{0}) = 0;

  // Declares `peer` lost: pending and later requests with it fail with "rank <peer> lost:
  // <reason>".
  virtual void fail_peer(int peer, const std::string& reason) = 0;
  // The reason `peer` was declared lost, or empty while it is alive.
  virtual std::string peer_failure(int peer) const = 0;

  // Whether `peer` is a process on this host (same host, boot, IPC and pid namespace), so that the
  // algorithms may read its memory directly (process_vm_readv). False where the transport cannot
  // tell; the algorithms then use messages only.
  virtual bool same_host(int peer) const { return false; }

  // Bytes moved so far by this rank (for introspection).
  virtual std::uint64_t bytes_sent() const = 0;
  virtual std::uint64_t bytes_received() const = 0;
};

}  // namespace troupe::collective
