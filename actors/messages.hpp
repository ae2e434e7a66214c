// The control messages of the actor runtime: small typed structs, one CAF type-ID block, every type
// inspect()'d (CAF 0.17 style) so it crosses process boundaries. Tensor bytes never travel in
// these: tensor_announce carries the handle, the bytes go over the transport.
//
// Included only by the actors/*.cpp files that talk CAF (coordinator.cpp, node.cpp, roles.cpp).
#pragma once

#include <caf/actor.hpp>
#include <caf/atom.hpp>
#include <caf/meta/type_name.hpp>
#include <caf/type_id.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "actors/introspection/snapshot.hpp"

namespace troupe::actors::msg {

using tick_atom = caf::atom_constant<caf::atom("tick")>;
using describe_atom = caf::atom_constant<caf::atom("describe")>;
using snapshot_atom = caf::atom_constant<caf::atom("snapshot")>;
using shutdown_atom = caf::atom_constant<caf::atom("shutdown")>;
using exited_atom = caf::atom_constant<caf::atom("exited")>;  // launcher: (rank, pid, how)

// A rank asks to join: the token, who it is, where its node actor listens, its UCX address.
struct join_request {
  std::string token;
  std::int32_t rank = -1;        // -1: a joiner (troupe launch --join), any lost rank's place
  std::int32_t world_size = -1;  // -1: unknown, learnt from the reply
  std::int32_t local_rank = 0;
  std::string host;
  std::int32_t pid = 0;
  std::string endpoint_host;  // the node actor's published address
  std::uint16_t endpoint_port = 0;
  caf::actor node;
};

struct member_info {
  std::int32_t rank = -1;
  std::string host;
  std::int32_t pid = 0;
  std::string endpoint_host;
  std::uint16_t endpoint_port = 0;
  caf::actor node;
};

// The answer to join_request, sent once every rank has joined (or at once when refused).
struct join_reply {
  bool accepted = false;
  std::string reason;  // why it was refused
  std::string job;
  std::int32_t world_size = 0;
  std::int64_t heartbeat_interval_ms = 0;
  std::int64_t heartbeat_timeout_ms = 0;
  std::vector<member_info> members;  // by rank
  // Why each rank is not in good standing ("" when it is): a rank that rejoins a running job
  // learns who is gone.
  std::vector<std::string> member_status;
  std::int32_t rank = -1;  // the rank it joins as (a joiner learns its rank here)
};

// Once the world is known every rank makes its transport and sends its UCX worker address; the
// reply (when all have) carries every rank's address.
struct address_request {
  std::int32_t rank = -1;
  std::vector<char> ucx_address;
};
struct address_reply {
  bool ok = false;
  std::string error;
  std::vector<std::vector<char>> addresses;  // by rank
};

// A rank connected its transport to every peer; the reply comes when all have.
struct ready_request {
  std::int32_t rank = -1;
};
struct ready_reply {
  bool ok = false;
  std::string error;
  std::uint64_t epoch = 0;
};

struct heartbeat {
  std::int32_t rank = -1;
  std::uint64_t epoch = 0;
};
struct coordinator_beat {
  std::uint64_t epoch = 0;
};

// Membership changes, broadcast by the coordinator to every member in good standing.
struct member_lost {
  std::int32_t rank = -1;
  std::string reason;
  std::uint64_t epoch = 0;
};
struct member_left {
  std::int32_t rank = -1;
  std::uint64_t epoch = 0;
};

// A lost rank came back (a new process took its place): survivors connect to it and answer with
// joined_ack; the new process starts once every survivor has.
struct member_joined {
  std::int32_t rank = -1;
  member_info info;
  std::vector<char> ucx_address;
  std::uint64_t epoch = 0;
};
struct joined_ack {
  std::int32_t rank = -1;  // who acknowledges
  std::int32_t joined = -1;
  std::uint64_t epoch = 0;
};

struct leave_request {
  std::int32_t rank = -1;
};
struct barrier_request {
  std::int32_t rank = -1;
  std::string name;
};
// A member's line for the job's event log (node::note_event); answered with a barrier_reply.
struct job_event {
  std::int32_t rank = -1;
  std::string kind;  // one of note_event_kinds
  std::string detail;
};
// The kinds a member may note (the others are the coordinator's own).
inline constexpr std::array<std::string_view, 1> note_event_kinds = {"recovery"};
// Also the answer to leave_request and job_event.
struct barrier_reply {
  bool ok = false;
  std::string error;
};

// A tensor handle: the bytes follow over the transport under tensor_tag(channel, seq).
struct tensor_announce {
  std::int32_t source = -1;
  std::uint64_t id = 0;
  std::uint32_t seq = 0;
  std::uint16_t channel = 0;
  std::uint8_t type = 0;  // troupe::dtype
  std::vector<std::int64_t> shape;
  std::uint64_t bytes = 0;
  std::string name;
};

// Role actors: spawn (or look up, by channel) on a node, requests and replies, stop.
struct spawn_request {
  std::string role;
  std::string name;
};
struct lookup_request {
  std::uint16_t channel = 0;
};
struct spawn_reply {
  bool ok = false;
  std::string error;
  std::string name;
  std::string role;
  std::uint16_t channel = 0;
  caf::actor actor;
};
struct stop_request {
  std::uint16_t channel = 0;
};
struct role_request {
  std::uint64_t corr = 0;  // the asker's correlation id
  std::string kind;
  std::vector<char> payload;
};
struct role_reply {
  std::uint64_t corr = 0;
  bool ok = false;
  std::string error;
  std::string kind;
  std::vector<char> payload;
};

template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, join_request& x) {
  return f(caf::meta::type_name("troupe::join_request"), x.token, x.rank, x.world_size,
           x.local_rank, x.host, x.pid, x.endpoint_host, x.endpoint_port, x.node);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, member_info& x) {
  return f(caf::meta::type_name("troupe::member_info"), x.rank, x.host, x.pid, x.endpoint_host,
           x.endpoint_port, x.node);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, join_reply& x) {
  return f(caf::meta::type_name("troupe::join_reply"), x.accepted, x.reason, x.job, x.world_size,
           x.heartbeat_interval_ms, x.heartbeat_timeout_ms, x.members, x.member_status, x.rank);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, address_request& x) {
  return f(caf::meta::type_name("troupe::address_request"), x.rank, x.ucx_address);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, address_reply& x) {
  return f(caf::meta::type_name("troupe::address_reply"), x.ok, x.error, x.addresses);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ready_request& x) {
  return f(caf::meta::type_name("troupe::ready_request"), x.rank);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, ready_reply& x) {
  return f(caf::meta::type_name("troupe::ready_reply"), x.ok, x.error, x.epoch);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, heartbeat& x) {
  return f(caf::meta::type_name("troupe::heartbeat"), x.rank, x.epoch);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, coordinator_beat& x) {
  return f(caf::meta::type_name("troupe::coordinator_beat"), x.epoch);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, member_lost& x) {
  return f(caf::meta::type_name("troupe::member_lost"), x.rank, x.reason, x.epoch);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, member_left& x) {
  return f(caf::meta::type_name("troupe::member_left"), x.rank, x.epoch);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, member_joined& x) {
  return f(caf::meta::type_name("troupe::member_joined"), x.rank, x.info, x.ucx_address, x.epoch);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, joined_ack& x) {
  return f(caf::meta::type_name("troupe::joined_ack"), x.rank, x.joined, x.epoch);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, job_event& x) {
  return f(caf::meta::type_name("troupe::job_event"), x.rank, x.kind, x.detail);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, leave_request& x) {
  return f(caf::meta::type_name("troupe::leave_request"), x.rank);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, barrier_request& x) {
  return f(caf::meta::type_name("troupe::barrier_request"), x.rank, x.name);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, barrier_reply& x) {
  return f(caf::meta::type_name("troupe::barrier_reply"), x.ok, x.error);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, tensor_announce& x) {
  return f(caf::meta::type_name("troupe::tensor_announce"), x.source, x.id, x.seq, x.channel,
           x.type, x.shape, x.bytes, x.name);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, spawn_request& x) {
  return f(caf::meta::type_name("troupe::spawn_request"), x.role, x.name);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, lookup_request& x) {
  return f(caf::meta::type_name("troupe::lookup_request"), x.channel);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, spawn_reply& x) {
  return f(caf::meta::type_name("troupe::spawn_reply"), x.ok, x.error, x.name, x.role, x.channel,
           x.actor);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, stop_request& x) {
  return f(caf::meta::type_name("troupe::stop_request"), x.channel);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, role_request& x) {
  return f(caf::meta::type_name("troupe::role_request"), x.corr, x.kind, x.payload);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, role_reply& x) {
  return f(caf::meta::type_name("troupe::role_reply"), x.corr, x.ok, x.error, x.kind, x.payload);
}

}  // namespace troupe::actors::msg

// The introspection structs travel between nodes and the coordinator too.
namespace troupe::actors {
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, collective_op& x) {
  return f(caf::meta::type_name("troupe::collective_op"), x.communicator, x.seq, x.op, x.dtype,
           x.count, x.peer, x.state, x.start_us, x.end_us, x.age_s);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, step_sample& x) {
  return f(caf::meta::type_name("troupe::step_sample"), x.step, x.uptime_s, x.values);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, actor_state& x) {
  return f(caf::meta::type_name("troupe::actor_state"), x.name, x.role, x.rank, x.mesh, x.activity,
           x.mailbox_depth, x.messages_sent, x.messages_received, x.bytes_sent, x.bytes_received,
           x.uptime_s, x.metrics, x.collectives, x.history);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, membership_event& x) {
  return f(caf::meta::type_name("troupe::membership_event"), x.uptime_s, x.epoch, x.rank, x.kind,
           x.detail);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, member_state& x) {
  return f(caf::meta::type_name("troupe::member_state"), x.rank, x.host, x.pid, x.status,
           x.last_heartbeat_age_s);
}
template <class Inspector>
typename Inspector::result_type inspect(Inspector& f, job_snapshot& x) {
  return f(caf::meta::type_name("troupe::job_snapshot"), x.job, x.world_size, x.uptime_s, x.members,
           x.actors, x.events, x.event_counts);
}

// The messages waiting in an actor's mailbox that it has already sorted into its queues (its
// describe answer's mailbox depth). Not mailbox().size(): in CAF 0.17 that first moves the inbox
// into the queues through task_queue::promote, a cast of the queue's sentinel that UBSan rejects.
template <class Self>
std::uint64_t queued_messages(Self* self) {
  return static_cast<std::uint64_t>(self->mailbox().queue().total_task_size());
}
}  // namespace troupe::actors

CAF_BEGIN_TYPE_ID_BLOCK(troupe_actors, caf::first_custom_type_id)
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::join_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::member_info))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::join_reply))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::address_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::address_reply))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::ready_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::ready_reply))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::heartbeat))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::coordinator_beat))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::member_lost))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::member_left))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::member_joined))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::joined_ack))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::leave_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::barrier_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::barrier_reply))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::tensor_announce))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::spawn_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::lookup_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::spawn_reply))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::stop_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::role_request))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::role_reply))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::actor_state))
CAF_ADD_TYPE_ID(troupe_actors, (std::vector<troupe::actors::actor_state>))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::job_snapshot))
CAF_ADD_TYPE_ID(troupe_actors, (troupe::actors::msg::job_event))
CAF_END_TYPE_ID_BLOCK(troupe_actors)
