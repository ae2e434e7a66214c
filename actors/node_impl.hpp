// Internal to actors/node.cpp and actors/roles.cpp: the state behind node's pimpl.
#pragma once

#include <caf/actor.hpp>
#include <caf/actor_system.hpp>
#include <caf/node_id.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "actors/caf_system.hpp"
#include "actors/coordinator.hpp"
#include "actors/node.hpp"
#include "actors/roles.hpp"
#include "collective/communicator.hpp"
#include "collective/ucx/ucx_transport.hpp"

namespace troupe::actors {

using steady = std::chrono::steady_clock;

namespace detail {

// The communicators one actor (a role actor, or the node) shows in its describe answer. Reading
// them (records()) and removing one (remove()) hold the same mutex, so once remove() returns the
// communicator is never touched again (collective_watch relies on it).
class watch_list {
 public:
  std::uint64_t add(collective::communicator& c);
  void remove(std::uint64_t id);
  // The chosen records of every watched communicator (select_records), by watch order.
  std::vector<collective_op> records();

 private:
  struct entry {
    collective::communicator* comm = nullptr;
    std::string name;
    // The latest time the communicator's clock can have started: its creation is no later than
    // the watch, nor than any observation minus the time a record shows.
    steady::time_point origin;
  };
  std::mutex mu_;
  std::map<std::uint64_t, entry> entries_;
  std::uint64_t next_id_ = 1;
};

// Of one communicator's flight records (oldest first, as recent() gives them) the ones a describe
// answer shows: the last `keep`, every older unfinished one and the last finished one, oldest
// first. `now_us` is the time of the snapshot on the communicator's clock (for age_s).
std::vector<collective_op> select_records(const std::string& communicator,
                                          const std::vector<collective::flight_record>& records,
                                          double now_us, std::size_t keep = 8);

}  // namespace detail

// Statistics and introspection of one role actor, shared by the actor and its role_context.
class role_actor_state {
 public:
  std::mutex mu;
  std::string activity = "idle";
  std::map<std::string, double> metrics;
  std::map<std::string, int> mesh;
  // role_context::record_step's samples, oldest first: the steps on the stride's grid (counted
  // from the first), then the latest when it is off the grid (`tail`).
  std::deque<step_sample> history;
  std::int64_t history_stride = 1;
  bool history_tail = false;
  std::atomic<std::uint64_t> msgs_in{0}, msgs_out{0}, bytes_in{0}, bytes_out{0};
  steady::time_point born = steady::now();
  // Communicators watched through role_context::watch (their records go into describe).
  std::shared_ptr<detail::watch_list> watched = std::make_shared<detail::watch_list>();
};

namespace detail {
struct local_transfer {
  std::mutex mu;
  std::condition_variable cv;
  const void* data = nullptr;
  std::size_t bytes = 0;
  bool done = false;
  std::string error;
};
}  // namespace detail

struct local_role {
  role_handle handle;
  caf::actor actor;
  std::shared_ptr<role_actor_state> state;
};

struct node::impl {
  node& owner;
  node_options opts;
  join_info info;
  std::string job_name, coordinator_endpoint;
  int rank = -1, world = 0, local_rank = 0;
  steady::time_point born = steady::now();

  std::unique_ptr<actors::coordinator> hosted;  // Slurm / torchrun rank 0
  std::unique_ptr<caf::actor_system_config> cfg;
  std::unique_ptr<caf::actor_system> sys;
  std::unique_ptr<collective::ucx_transport> ucx;
  caf::actor node_actor, coordinator_actor;
  std::int64_t heartbeat_interval_ms = 750, heartbeat_timeout_ms = 3000;

  // Membership (mu).
  mutable std::mutex mu;
  std::condition_variable cv;
  std::vector<msg::member_info> members;
  std::vector<std::string> lost;  // reason by rank; empty: in good standing
  std::vector<bool> left;
  std::vector<std::uint32_t> incarnation;  // +1 each time a new process takes the rank
  std::string expelled;  // non-empty: this rank can no longer talk to the job (and why)
  std::uint64_t epoch = 0;
  std::set<caf::node_id> member_nodes;  // processes allowed to talk to this node's actors
  bool started = false;

  // Direct handles on the peers' node actors (connect_mu), connected on first use.
  std::mutex connect_mu;
  std::vector<caf::actor> direct;

  // Tensors (mu): sequence numbers per (dest, channel), the inbox of channel 0 and its claims.
  std::map<std::pair<int, int>, std::uint32_t> send_seq;
  std::atomic<std::uint64_t> next_buffer_id{1};
  std::deque<tensor_info> inbox;
  std::vector<std::uint32_t> next_claim;  // per source: the next seq a consumer takes
  std::map<std::pair<int, std::uint32_t>, tensor_info> claimed;  // pre-posted, announced
  std::set<std::pair<int, std::uint32_t>> unwanted;  // received without waiting: drop on arrival
  // Tensors from this rank to its own role actors, by (channel, seq), until received.
  std::map<std::pair<std::uint16_t, std::uint32_t>, std::shared_ptr<detail::local_transfer>>
      local_sends;

  // Roles hosted here (touched by the node actor only, except live_roles).
  std::map<std::uint16_t, local_role> roles;
  std::uint16_t next_channel = 1;
  std::mutex roles_mu;
  std::condition_variable roles_cv;
  int live_roles = 0;
  std::atomic<int> live_jobs{0};

  // Introspection of the node itself.
  std::atomic<std::uint64_t> msgs_in{0}, msgs_out{0};
  std::string activity = "running";  // mu
  // Communicators watched through node::watch (their records go into the node's describe).
  std::shared_ptr<detail::watch_list> watched = std::make_shared<detail::watch_list>();

  // Membership callbacks, run on their own thread.
  std::map<int, std::function<void(const member_event&)>> callbacks;  // cb_mu
  int next_callback = 1;
  std::mutex cb_mu;
  std::condition_variable cb_cv;
  std::deque<member_event> events;
  bool cb_stop = false;
  bool dispatching = false;  // callbacks are running (outside cb_mu)
  std::thread dispatcher;

  std::vector<caf::actor> extra_actors;  // mu: helpers that stop with the node (bench echo)
  bool shut_down = false;

  explicit impl(node& n) : owner(n) {}

  // Called by the node actor.
  void on_lost(int r, const std::string& reason, std::uint64_t ep);
  void on_left(int r, std::uint64_t ep);
  void on_joined(const msg::member_joined& m);
  void on_coordinator_lost(const std::string& reason);
  void deliver(const msg::tensor_announce& a);
  // Why an announcement from `sender` is refused (its source is another rank than the sender's),
  // or empty when it is the sender's own.
  std::string announce_refusal(const msg::tensor_announce& a, const caf::node_id& sender);
  std::atomic<std::uint64_t> refused_announces{0};
  bool is_member_node(const caf::node_id& n) const;

  // The failure that makes waiting on `from` pointless (its loss, or this rank's), or empty.
  std::string failure_of(int from) const;  // mu held
  caf::actor peer(int r);
  std::string describe_rank(int r) const;  // "rank 2 (host, pid 123)"
  void post_event(member_event e);
  void set_activity(std::string a) {
    std::lock_guard<std::mutex> lock(mu);
    activity = std::move(a);
  }
};

// Spawns the detached CAF actor of a role (actors/roles.cpp).
caf::actor spawn_role_actor(node::impl& n, const role_handle& handle, role_builder builder,
                            std::shared_ptr<role_actor_state> state,
                            std::shared_ptr<role_context> ctx);
// The describe answer of a role actor from its shared state (when it is too busy to answer).
actor_state role_state_snapshot(const role_handle& h, role_actor_state& s, std::uint64_t mailbox);

}  // namespace troupe::actors
