// How a rank process finds its job: the coordinator's address, the job token, its rank and the
// world size, read from the variables `troupe launch` sets (TROUPE_*), from Slurm (SLURM_PROCID,
// SLURM_NTASKS, SLURM_NODELIST) or from torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
// Also the helpers of the launcher that need no actor system: hostfiles, Slurm host lists, job
// tokens, the network device behind an address. Pure functions, tested without processes.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "actors/tls.hpp"
#include "memory/error.hpp"

namespace troupe::actors {

// The default coordinator port under Slurm and with hostfiles (TROUPE_PORT / --port override it).
inline constexpr int default_coordinator_port = 29400;

struct join_info {
  std::string coordinator;  // "host:port" of the coordinator to join
  std::string token;        // the job token (secret)
  int rank = -1;        // -1 with TROUPE_JOIN=1: a joiner, given a lost rank's place when it joins
  int world_size = -1;  // -1: learnt from the coordinator when joining
  int local_rank = 0;   // index among the ranks on this host
  // Under Slurm and torchrun rank 0 starts the coordinator in its own process, listening here.
  bool host_coordinator = false;
  std::string coordinator_bind;
  std::string bind = "127.0.0.1";  // the address this rank's own listener binds to
  std::string net_device;          // the UCX network device ("lo", "eth0"; empty: UCX's choice)
  tls_options tls;     // TROUPE_TLS_CERT / _KEY / _CA: the control plane over TLS (actors/tls.hpp)
  std::string source;  // "troupe launch", "slurm", "torchrun" or "options"
};

// Reads the environment through `get` (getenv by default). A failure names the variable.
using env_lookup = std::function<const char*(const char*)>;
expected<join_info> join_info_from_env(const env_lookup& get = {});

// Slurm's compressed host list: "node[01-03,7],gpu5" -> node01 node02 node03 node7 gpu5.
expected<std::vector<std::string>> expand_nodelist(const std::string& list);

// A hostfile: one "host slots=N" per line ('#' starts a comment; "slots=" may be left out: 1).
struct host_slots {
  std::string host;
  int slots = 1;
};
expected<std::vector<host_slots>> parse_hostfile_text(const std::string& text,
                                                      const std::string& source);
expected<std::vector<host_slots>> read_hostfile(const std::string& path);
// The index of this host in the hostfile: its host name, short or fully qualified, or an address
// of one of its interfaces; a failure lists the names tried.
expected<int> find_host_index(const std::vector<host_slots>& hosts);

// A fresh job token: 128 random bits as 32 hex digits (from getrandom).
std::string generate_token();
// The first line of `path`, trimmed; a failure names the file (missing, unreadable or empty).
expected<std::string> read_token_file(const std::string& path);
// Compares two tokens in time independent of where they differ.
bool tokens_equal(const std::string& a, const std::string& b);

// The network interface that owns `address` ("lo" for loopback addresses); empty for wildcard
// or unknown addresses (UCX then picks its devices itself).
std::string net_device_for(const std::string& address);
// gethostname(), or "localhost" when it fails.
std::string this_host();

}  // namespace troupe::actors
