// The coordinator of a job: admits ranks that present the job token, hands every rank the member
// list (with the peers' UCX addresses), watches every member (CAF monitor plus heartbeats) and
// broadcasts member_lost when one dies or goes silent. It also runs barriers and aggregates the
// job snapshot for introspection (HTTP endpoint + the job registry `troupe ps` reads).
//
// It runs in the launcher (`troupe launch`), or in rank 0 under Slurm and torchrun. It ignores
// every message from actors of processes that have not joined. A new process with the token may
// take the place of a lost rank in a running job: the survivors connect to it (member_joined)
// before it starts. No CAF type appears here.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "actors/introspection/snapshot.hpp"
#include "actors/tls.hpp"

namespace troupe::actors {

struct coordinator_options {
  std::string job;    // the job's name (a valid file name: letters, digits, '-', '_', '.')
  std::string token;  // the job token every rank must present
  int world_size = 1;
  std::string bind = "127.0.0.1";                     // listen address
  std::uint16_t port = 0;                             // 0: any free port
  std::chrono::milliseconds heartbeat_timeout{3000};  // heartbeats go every timeout / 4
  tls_options tls;         // enabled: ranks join over TLS only (checked by the caller: check_tls)
  bool serve_http = true;  // the introspection endpoint
  std::string http_bind = "127.0.0.1";
  std::uint16_t http_port = 0;
  // Host names the endpoint answers besides loopback and http_bind ("*": any; http_server.hpp).
  std::vector<std::string> http_allowed_hosts;
  bool register_job = true;  // announce the endpoint to `troupe ps` (needs serve_http)
  // Where log lines go (default: stderr, prefixed "troupe coordinator: ").
  std::function<void(const std::string&)> log;
};

class coordinator {
 public:
  // Starts an actor system, publishes the coordinator at bind:port and starts the HTTP endpoint;
  // throws troupe::error naming the address when it cannot listen.
  explicit coordinator(coordinator_options options);
  ~coordinator();
  coordinator(const coordinator&) = delete;
  coordinator& operator=(const coordinator&) = delete;

  std::uint16_t port() const;
  std::string endpoint() const;       // "bind:port"
  std::string http_endpoint() const;  // "host:port", empty without HTTP
  const std::string& job() const;

  // Members that joined so far, and whether every member has left or been lost after the start.
  int joined() const;
  bool finished() const;
  // Blocks until finished() or the timeout passes; returns finished().
  bool wait_finished(std::chrono::milliseconds timeout);

  // Asks every member for its actors (each answering within `timeout`) and returns the job view.
  job_snapshot snapshot(std::chrono::milliseconds timeout = std::chrono::milliseconds{1000});

  // The launcher saw the process `pid` of `rank` end (`how`: "exited with status 1"): a member
  // that did not leave is lost at once, and a rank that never joined makes the job fail to form
  // instead of leaving the others waiting. (A rank now held by another process is not touched.)
  void process_ended(int rank, int pid, const std::string& how);
  // Whether another process (a joiner: troupe launch --join) now holds `rank`, whose process
  // `pid` ended: the launcher then no longer counts that end as the job's failure.
  bool taken_over(int rank, int pid) const;

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::actors
