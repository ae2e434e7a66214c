// The in-process transport: N ranks as threads of one process, for fast tests of the collectives.
//
// A local_world owns N local_transports, one per rank. A send and a receive meet in the receiver's
// mailbox, matched per (source, tag) in posting order (FIFO per pair and tag, as transport.hpp
// requires); whichever side posts second copies the bytes with one memcpy, straight from the send
// buffer into the receive buffer, and completes both. A send therefore completes only once its
// receive is posted (no eager buffering), which makes the tests strict about deadlock-prone
// schedules that UCX's eager path would hide.
//
// Waiting spins for a moment, then sleeps on a futex (ranks share few cores). A wait that times out
// leaves its request pending, so the caller may wait on it again.
//
// A world made with `same_host` says that its ranks may read each other's memory directly
// (transport::same_host): the threads share one process, so process_vm_readv on its own pid works
// and the communicators' direct paths (collective/README.md) run on threads, for fast tests of
// them.
//
// local_world::fail_peer(k, reason) simulates losing rank k: every survivor's transport gets
// fail_peer(k, reason), and rank k's own pending and later requests fail too, so its threads
// unwind.
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collective/communicator.hpp"
#include "collective/transport.hpp"

namespace troupe::collective {

class local_world;

class local_transport final : public transport {
 public:
  local_transport(local_world& world, int rank);
  ~local_transport() override;
  local_transport(const local_transport&) = delete;
  local_transport& operator=(const local_transport&) = delete;

  int rank() const override { return rank_; }
  int size() const override;

  p2p_request isend(int peer, std::uint64_t tag, const void* data, std::size_t bytes) override;
  p2p_request irecv(int peer, std::uint64_t tag, void* data, std::size_t bytes) override;
  bool test(p2p_request& r) override;
  void wait(p2p_request& r,
            std::chrono::milliseconds timeout = std::chrono::milliseconds{0}) override;

  void fail_peer(int peer, const std::string& reason) override;
  std::string peer_failure(int peer) const override;
  bool same_host(int peer) const override;

  std::uint64_t bytes_sent() const override { return sent_.load(std::memory_order_relaxed); }
  std::uint64_t bytes_received() const override {
    return received_.load(std::memory_order_relaxed);
  }

  struct mailbox;  // defined in the .cpp

 private:
  friend class local_world;
  void check_peer(int peer, const char* what) const;
  // Fails this rank's pending requests with `peer` (peer == rank_: all of them) with `message`.
  void fail_pending_with(int peer, const std::string& message);
  void lose_self(const std::string& reason);

  local_world& world_;
  int rank_;
  std::unique_ptr<mailbox> box_;  // receives addressed to this rank meet their sends here
  mutable std::mutex fail_mu_;
  std::vector<std::string> failures_;  // per peer; empty while alive
  std::unique_ptr<std::atomic<bool>[]> failed_;
  std::atomic<bool> self_lost_{false};
  std::string self_reason_;
  std::atomic<std::uint64_t> sent_{0}, received_{0};
};

class local_world {
 public:
  explicit local_world(int n, bool same_host = false);
  ~local_world();
  local_world(const local_world&) = delete;
  local_world& operator=(const local_world&) = delete;

  int size() const { return static_cast<int>(ranks_.size()); }
  local_transport& transport(int rank);
  bool same_host() const { return same_host_; }

  // Loses rank `rank`: survivors see "rank <rank> lost: <reason>" on every request with it, and
  // rank `rank`'s own requests fail the same way.
  void fail_peer(int rank, const std::string& reason);

 private:
  std::vector<std::unique_ptr<local_transport>> ranks_;
  bool same_host_ = false;
};

// N communicators over one local_world (group id 0, ranks 0..n-1, named "local#0[...]"), one per
// rank; they keep the world alive. For tests: drive communicator i from its own thread.
std::vector<std::unique_ptr<communicator>> make_local_group(int n);
// The same over a world the caller owns (to call world.fail_peer in tests).
std::vector<std::unique_ptr<communicator>> make_local_group(std::shared_ptr<local_world> world,
                                                            std::uint32_t group_id = 0);

}  // namespace troupe::collective
