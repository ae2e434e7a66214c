// What introspection reports: plain structs, free of CAF, filled by the actors and rendered as
// JSON, Prometheus text, `troupe ps` and `troupe top`.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace troupe::actors {

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
  std::map<std::string, double> metrics;  // role-specific numbers (loss, step, bytes per tier...)
};

// One member (rank process) of the job as the coordinator sees it.
struct member_state {
  int rank = -1;
  std::string host;
  int pid = 0;
  std::string status;  // "alive", "lost: <reason>"
  double last_heartbeat_age_s = 0;
};

struct job_snapshot {
  std::string job;  // job name
  int world_size = 0;
  double uptime_s = 0;
  std::vector<member_state> members;
  std::vector<actor_state> actors;
};

}  // namespace troupe::actors
