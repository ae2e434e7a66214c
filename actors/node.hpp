// A rank of a troupe job: the process-wide runtime a program gets by joining its job.
//
// Constructing a node joins the coordinator (found through the environment `troupe launch`, Slurm
// or torchrun set: actors/bootstrap.hpp), exchanges UCX worker addresses with every peer and
// returns once every rank has joined and connected. From then on:
//   - transport() moves bytes between ranks (make communicators from it with collective/),
//   - send_tensor() / next_tensor() / receive() move tensors by handle: a small CAF message
//     announces (buffer id, dtype, shape, sequence number, source) and the bytes go over the
//     transport straight into the receiver's buffer,
//   - membership callbacks report lost ranks (a dead process, or one silent for the heartbeat
//     timeout); the transport fails every pending and later request with a lost rank,
//   - role actors (actors/roles.hpp) answer requests from actor scripts.
// No CAF type appears here; the actor system lives behind the pimpl.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "actors/bootstrap.hpp"
#include "collective/transport.hpp"
#include "memory/buffer.hpp"
#include "tensor/dtype.hpp"

namespace troupe::collective {
class communicator;
}

namespace troupe::actors {

class role_registry;
struct role_handle;

namespace detail {
class watch_list;
}

// A communicator whose flight recorder (collective::communicator::recent()) appears in an actor's
// describe answer, hence in `troupe ps` / `troupe top` and the HTTP endpoint, until this handle is
// destroyed or unwatch() is called (node::watch, role_context::watch). Move-only.
// Lifetime rule: the communicator must outlive the registration. Destroy the handle (or call
// unwatch()) before the communicator: declared after the communicator it watches, it goes first.
// Once unwatch() returns, introspection no longer touches the communicator. A handle that outlives
// its actor or node is harmless.
class collective_watch {
 public:
  collective_watch() = default;
  collective_watch(std::weak_ptr<detail::watch_list> list, std::uint64_t id)
      : list_(std::move(list)), id_(id) {}
  ~collective_watch() { unwatch(); }
  collective_watch(collective_watch&& o) noexcept : list_(std::move(o.list_)), id_(o.id_) {
    o.id_ = 0;
  }
  collective_watch& operator=(collective_watch&& o) noexcept;
  collective_watch(const collective_watch&) = delete;
  collective_watch& operator=(const collective_watch&) = delete;

  void unwatch() noexcept;
  bool active() const { return id_ != 0 && !list_.expired(); }

 private:
  std::weak_ptr<detail::watch_list> list_;
  std::uint64_t id_ = 0;
};

struct node_options {
  // Where to join; read from the environment when empty (actors/bootstrap.hpp).
  std::optional<join_info> join;
  // The roles this rank can host (actors/roles.hpp); must outlive the node. May be null.
  const role_registry* roles = nullptr;
  // How long to wait for the coordinator and for the whole world to join.
  std::chrono::milliseconds join_timeout{60000};
  // CAF scheduler threads (policy `sharing`); 0: TROUPE_CAF_THREADS or 2.
  int caf_threads = 0;
  // Heartbeat timeout of a coordinator this process hosts (Slurm / torchrun rank 0).
  std::chrono::milliseconds heartbeat_timeout{3000};
  // Whether survivors keep exchanging tensors after losing a rank on their own host: endpoints
  // to local ranks then run over tcp loopback instead of shared memory (ucx_error_mode::peer),
  // because a rank killed mid-send can stall a shared-memory receiver for every sender.
  bool survive_local_loss = false;
  // While shutdown() runs longer than this, it says on stderr which step it is in ("troupe: rank
  // 2: shutdown still closing the UCX transport after 10 s"), then again every 6 such intervals.
  // <= 0 turns the report off.
  std::chrono::milliseconds shutdown_report{10000};
};

// An announced tensor, not yet received.
struct tensor_info {
  int source = -1;            // the sending rank
  std::uint64_t id = 0;       // the sender's buffer id (unique per sender)
  std::uint32_t seq = 0;      // sequence number on (source, this rank, channel)
  std::uint16_t channel = 0;  // 0: the node's inbox; else a role actor's
  std::uint64_t tag = 0;      // the transport tag the bytes travel under (bit 47 set)
  dtype type = dtype::u8;
  std::vector<std::int64_t> shape;
  std::size_t bytes = 0;
  std::string name;  // the sender's label ("activations/3"), may be empty
};

// A received tensor that owns its bytes.
struct received_tensor {
  tensor_info info;
  memory::buffer data;
};

namespace detail {
struct local_transfer;  // a tensor to a role actor on the sender's own rank
}

// A posted tensor send: the source buffer must stay untouched until wait() returns.
class tensor_send {
 public:
  tensor_send() = default;
  tensor_send(collective::transport* t, collective::p2p_request r, tensor_info info)
      : t_(t), r_(std::move(r)), info_(std::move(info)) {}
  tensor_send(std::shared_ptr<detail::local_transfer> local, tensor_info info)
      : local_(std::move(local)), info_(std::move(info)) {}
  // Throws troupe::error when the transfer failed (receiver lost) or timed out.
  void wait(std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
  bool test();
  const tensor_info& info() const { return info_; }

 private:
  collective::transport* t_ = nullptr;
  collective::p2p_request r_;
  std::shared_ptr<detail::local_transfer> local_;
  tensor_info info_;
};

class node;

// A pre-posted receive of the next tensor from one rank (node::post_receive_next).
class tensor_recv {
 public:
  tensor_recv() = default;
  // Blocks until the bytes and the announcement are in; returns the announcement. Throws when the
  // sender is lost, the sizes differ or the timeout (0: none) passes.
  tensor_info wait(std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
  // Blocks until the bytes are in, without waiting for the announcement (the receiver knows the
  // shape already; the transport has checked the size). The announcement, when it comes, is
  // dropped. Returns what is known: source, seq, tag, bytes, and the rest if it was announced.
  tensor_info wait_data(std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
  bool valid() const { return n_ != nullptr; }

 private:
  friend class node;
  node* n_ = nullptr;
  collective::p2p_request r_;
  int from_ = -1;
  std::uint32_t seq_ = 0;
  std::size_t bytes_ = 0;
  std::optional<tensor_info> info_;
};

// A change of the member list.
struct member_event {
  enum kind_t { lost, left, joined } kind = lost;  // joined: a new process took a lost rank
  int rank = -1;                                   // -1: the coordinator itself was lost
  std::string reason;  // "process exited", "no heartbeat for 3.0 s", ...
  std::uint64_t epoch = 0;
};

class node {
 public:
  // Joins the job; throws troupe::error (coordinator unreachable, wrong token, world incomplete
  // before join_timeout) naming the coordinator and the cause.
  explicit node(node_options options = {});
  // shutdown(), if not called yet.
  ~node();
  node(const node&) = delete;
  node& operator=(const node&) = delete;

  int rank() const;
  int world_size() const;
  int local_rank() const;
  const std::string& job() const;           // the job's name
  const std::string& coordinator() const;   // "host:port"
  std::uint64_t epoch() const;              // membership epoch: 1 at start, +1 per change
  std::vector<int> alive() const;           // ranks not lost and not left, ascending
  std::string lost_reason(int rank) const;  // empty while `rank` is a member in good standing

  // The data plane (a UCX transport connected to every peer). Tags with bit 47 set belong to
  // the actor runtime; collectives use the other half.
  collective::transport& transport();

  // Posts the bytes [data, data + bytes of shape) to `dest` and announces them. `id` 0 picks a
  // fresh buffer id.
  tensor_send send_tensor(int dest, const void* data, dtype type,
                          std::span<const std::int64_t> shape, const std::string& name = {},
                          std::uint64_t id = 0);
  // The same to a role actor (its on_tensor handler gets the announcement); the actor may live on
  // this rank (the bytes are then copied once, when it receives them).
  tensor_send send_tensor(const role_handle& dest, const void* data, dtype type,
                          std::span<const std::int64_t> shape, const std::string& name = {},
                          std::uint64_t id = 0);

  // Waits for the next announcement in this node's inbox (from `from`, or any rank when -1), in
  // sequence order per source. Throws when `from` is lost, or when the timeout (0: none) passes.
  tensor_info next_tensor(std::chrono::milliseconds timeout = std::chrono::milliseconds{0},
                          int from = -1);
  // Receives an announced tensor into `dst` (`bytes` must equal info.bytes); blocks until done.
  void receive(const tensor_info& info, void* dst, std::size_t bytes,
               std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
  // Receives an announced tensor into a fresh host buffer.
  received_tensor receive(const tensor_info& info,
                          std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
  // Pre-posts the receive of the next tensor from `from` into `dst` before its announcement
  // arrives (shapes known in advance, as in a pipeline); returns the announcement once both the
  // bytes and the announcement are in. A size mismatch is an error naming both sizes.
  tensor_info receive_next(int from, void* dst, std::size_t bytes,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
  // The same without blocking: post several to keep transfers back to back.
  tensor_recv post_receive_next(int from, void* dst, std::size_t bytes);

  // Calls `fn` (on a runtime thread; keep it short) for every membership change until removed or
  // shutdown; returns an id. A callback that refers to locals must be removed before they go.
  int on_membership(std::function<void(const member_event&)> fn);
  // After this returns, `id` is not running and never runs again.
  void remove_membership_callback(int id);

  // Adds a line to the job's event log (the snapshot's `events` and `event_counts`: the HTTP page,
  // /json, Prometheus' troupe_job_events_total) as this rank, e.g. kind "recovery" for an elastic
  // recovery. Waits until the coordinator recorded it; throws troupe::error naming the kind when
  // the coordinator refuses it (only msg::note_event_kinds) or does not answer within `timeout`.
  void note_event(const std::string& kind, const std::string& detail,
                  std::chrono::milliseconds timeout = std::chrono::milliseconds{5000});

  // Blocks until every member in good standing calls barrier() with the same name; throws when a
  // member is lost meanwhile or the timeout (0: none) passes.
  void barrier(const std::string& name = "barrier",
               std::chrono::milliseconds timeout = std::chrono::milliseconds{0});

  // Shows `c`'s recent operations in this node's describe answer (the "node@<rank>" row), for
  // communicators a plain node program makes; role actors use role_context::watch. See
  // collective_watch for the lifetime rule.
  [[nodiscard]] collective_watch watch(collective::communicator& c);

  // Leaves the job cleanly: tells the coordinator, stops local role actors, closes the transport
  // and the actor system. A rank that hosts the coordinator waits for the others to leave first.
  void shutdown();

  struct impl;
  impl& internals() { return *impl_; }

 private:
  friend class tensor_recv;
  tensor_info finish_receive(tensor_recv& r, std::chrono::milliseconds timeout, bool announced);
  std::unique_ptr<impl> impl_;
};

// The transport tag of a tensor on `channel` with sequence number `seq` (bit 47 set).
constexpr std::uint64_t tensor_tag(std::uint16_t channel, std::uint32_t seq) {
  return (std::uint64_t{1} << 47) | (std::uint64_t{channel & 0x7fffu} << 32) | seq;
}

}  // namespace troupe::actors
