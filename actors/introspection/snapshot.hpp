// What introspection reports: plain structs, free of CAF, filled by the actors and rendered as
// JSON, Prometheus text, `troupe ps` and `troupe top`, and shown by the dashboard (dashboard.hpp).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace troupe::actors {

// One entry of a watched communicator's flight recorder (collective::flight_record) as
// introspection shows it: what an actor issued on that communicator and how it ended. An actor
// reports, per communicator it watches (role_context::watch, node::watch), its last 8 operations,
// every older one still unfinished and the last finished one.
struct collective_op {
  std::string communicator;  // the communicator's name, e.g. "ucx:tp#3[0,1]"
  std::uint64_t seq = 0;     // per-communicator sequence number, from 1
  std::string op;            // "allreduce", "send", ... (collective::op_kind_name)
  std::string dtype;         // "f32", "bf16", ...
  std::uint64_t count = 0;   // elements (per rank for reduce_scatter / all_gather / all_to_all)
  int peer = -1;             // send/recv peer or broadcast root (group rank), else -1
  std::string state;         // "issued", "running", "done", "failed: <cause>"
  double start_us = 0;       // on the communicator's clock (microseconds since it was made)
  double end_us = 0;         // 0 while unfinished
  // Seconds from the issue to the moment the actor was described (a busy actor is described by
  // its node after 500 ms); a lower bound, exact when the communicator was watched right after it
  // was made.
  double age_s = 0;
  bool finished() const { return state != "issued" && state != "running"; }
};

// One finished step of a role actor, as it recorded it (role_context::record_step): the per-step
// series of the dashboard's charts.
struct step_sample {
  std::int64_t step = 0;                 // 1-based: steps done when it was recorded
  double uptime_s = 0;                   // the actor's uptime then
  std::map<std::string, double> values;  // "loss", "tokens_per_s", "memory.host_bytes", ...
};

// The answer of one role actor to `describe`.
struct actor_state {
  std::string name;                 // unique in the job, e.g. "stage/1" or "echo@2"
  std::string role;                 // "coordinator", "node", "stage", "tier-manager", user roles...
  int rank = -1;                    // world rank of the process it lives on
  std::map<std::string, int> mesh;  // mesh coordinates once there are meshes, e.g. {"dp":0,"pp":1}
  std::string activity;             // what it is doing now, e.g. "idle", "forward mb 3"
  std::uint64_t mailbox_depth = 0;
  std::uint64_t messages_sent = 0, messages_received = 0;
  std::uint64_t bytes_sent = 0, bytes_received = 0;
  double uptime_s = 0;
  std::map<std::string, double> metrics;   // role-specific numbers (loss, step, bytes per tier...)
  std::vector<collective_op> collectives;  // of the watched communicators, by communicator and seq
  std::vector<step_sample> history;        // its recent steps, oldest first (a bounded ring)
};

// One member (rank process) of the job as the coordinator sees it.
struct member_state {
  int rank = -1;
  std::string host;
  int pid = 0;
  std::string status;  // "alive", "lost: <reason>"
  double last_heartbeat_age_s = 0;
};

// A change of the job's membership as the coordinator saw it.
struct membership_event {
  double uptime_s = 0;      // the coordinator's uptime at the event
  std::uint64_t epoch = 0;  // the membership epoch after it (0 while the job forms)
  int rank = -1;            // the rank concerned; -1: the whole job
  // The coordinator's: "joined", "started", "lost", "left", "rejoining", "rejoined", "refused";
  // a member's (node::note_event): "recovery".
  std::string kind;
  std::string detail;  // the log line
};

struct job_snapshot {
  std::string job;  // job name
  int world_size = 0;
  double uptime_s = 0;
  std::vector<member_state> members;
  std::vector<actor_state> actors;
  std::vector<membership_event> events;  // oldest first, the most recent ones (a bounded log)
  // Every event since the job started, counted by kind (not bounded like `events`): e.g.
  // "recovery" (an elastic run replaced a lost rank: the training driver's line), "lost".
  std::map<std::string, std::uint64_t> event_counts;
};

}  // namespace troupe::actors
