// `troupe launch`: starts the coordinator (unless joining another launcher's) and the local rank
// processes, prefixes every line they print with "[rank k] ", and reports which ranks failed.
//
// One host:    launch -n 4 -- PROGRAM ARGS
// More hosts:  launch -n 2 --world-size 4 --bind 10.0.0.1 --port 29400 --token-file F -- ...  (host
// A)
//              launch -n 2 --coordinator 10.0.0.1:29400 --rank-offset 2 --bind 10.0.0.2
//                     --token-file F -- ...                                                   (host
//                     B)
//          or  launch --join --coordinator HOST:PORT --token-file F -- ...  (a joiner: takes a lost
//              rank's place in the running job)
//          or  launch --hostfile F --bind ADDR --token-file T -- ...  on every host ("host slots=N"
//              lines; the first host runs the coordinator, each launcher finds its own line).
// Each rank gets TROUPE_COORDINATOR, TROUPE_TOKEN, TROUPE_RANK, TROUPE_WORLD_SIZE,
// TROUPE_LOCAL_RANK, TROUPE_JOB, TROUPE_BIND and TROUPE_NET_DEVICE (actors/bootstrap.hpp), and with
// --tls TROUPE_TLS_CERT, TROUPE_TLS_KEY and TROUPE_TLS_CA (actors/tls.hpp).
#pragma once

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "actors/tls.hpp"

namespace troupe::actors {

struct launch_options {
  int nprocs = 0;                    // ranks on this host (0: from the hostfile)
  std::vector<std::string> command;  // PROGRAM ARGS
  std::string token, token_file;     // neither: a fresh random token (coordinator side only)
  std::string bind;                  // listen address of coordinator and ranks (default loopback)
  int port = 0;                      // coordinator port (0: any; hostfiles: 29400)
  double heartbeat_timeout_s = 3.0;
  std::string coordinator;  // "host:port": join that coordinator instead of starting one
  int rank_offset = 0;      // the first rank started here
  // Joiners (--join, with `coordinator` and the token): nprocs (default 1) processes that each
  // take a lost rank's place in the running job (TROUPE_JOIN=1 instead of TROUPE_RANK; the
  // coordinator gives the rank); an elastic troupe train makes them spares. Prefixed "[joiner i]".
  bool join = false;
  int world_size = 0;  // all ranks of the job (0: nprocs, or the hostfile's total)
  std::string hostfile;
  int host_index = -1;     // this host's line in the hostfile (-1: found by name)
  std::string job;         // the job's name (default: program name + random suffix)
  std::string net_device;  // UCX device (default: the device of --bind, "lo" on loopback)
  bool pin = false;        // pin local rank i to the i-th CPU this process may use
  double grace_s = 30.0;   // after a rank fails, the others get this long before SIGTERM
  // Ranks started after the nprocs ones (one host, this launcher's coordinator), told by
  // TROUPE_SPARES: an elastic `troupe train` keeps them idle until one takes a lost rank's place.
  // Up to `spares` ranks may fail without ending the others (no grace countdown) or failing the
  // launch, when every other rank ends well.
  int spares = 0;
  // An elastic run that shrinks onto its survivors (train's elastic.min_ranks, told by
  // TROUPE_MIN_RANKS): the ranks may go down to this many (spares included in the count started)
  // without ending the others or failing the launch; 0: no shrinking.
  int min_ranks = 0;
  bool prefix = true;  // "[rank k] " before every output line
  bool quiet = false;  // no launcher lines on stderr except errors
  // The coordinator's introspection endpoint: its listen address (default 127.0.0.1) and the Host
  // names it answers besides loopback and that address ("*": any; see http_server.hpp).
  std::string introspection_bind;
  std::vector<std::string> introspection_hosts;
  bool use_tls = false;  // the control plane over TLS with `tls` (--tls; checked up front)
  tls_options tls;       // --tls-cert, --tls-key, --tls-ca
  std::vector<std::pair<std::string, std::string>> env;  // extra environment for every rank
  // Called with (local index, rank, pid) after each rank starts (benchmarks, tests).
  std::function<void(int, int, int)> on_start;
};

// Runs the job to its end and returns the exit code: 0 when every local rank exited with 0, else
// 1 after naming the ranks that failed and how. Throws troupe::error for bad options (naming the
// flag or file) and when the coordinator cannot listen.
int launch(const launch_options& options);

}  // namespace troupe::actors
