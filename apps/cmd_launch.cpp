// `troupe launch`: run a program as the ranks of a job (actors/launcher.hpp does the work).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <memory>
#include <string>

#include "actors/launcher.hpp"
#include "apps/commands.hpp"

namespace troupe::apps {

command_fn add_launch_command(CLI::App& app) {
  auto o = std::make_shared<actors::launch_options>();
  auto* sub = app.add_subcommand(
      "launch",
      "Start a coordinator and N ranks of PROGRAM on this host (troupe launch -n 4 -- PROGRAM "
      "ARGS); every line they print is prefixed with [rank k]");
  sub->add_option("-n,--nprocs", o->nprocs, "Ranks to start on this host")
      ->check(CLI::PositiveNumber);
  sub->add_option("--spares", o->spares,
                  "Ranks started beyond -n that idle until one takes a lost rank's place (an "
                  "elastic troupe train); up to this many ranks may fail without failing the job")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--min-ranks", o->min_ranks,
                  "An elastic troupe train may shrink onto its survivors down to this many ranks "
                  "(told to it as its --min-ranks); the job goes on while that many run")
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--token", o->token, "Job token (default: 128 random bits)");
  sub->add_option("--token-file", o->token_file, "File whose first line is the job token");
  sub->add_option("--bind", o->bind,
                  "Address the coordinator and the ranks listen on (default 127.0.0.1)");
  sub->add_option("--port", o->port,
                  "Coordinator port (default: any free port; 29400 with --hostfile)");
  sub->add_option("--heartbeat-timeout", o->heartbeat_timeout_s,
                  "Seconds of silence after which a rank is declared lost")
      ->default_val(3.0);
  sub->add_option("--coordinator", o->coordinator,
                  "HOST:PORT of another launcher's coordinator: start ranks of that job here");
  sub->add_flag("--join", o->join,
                "Join the running job at --coordinator (with its --token or --token-file): each "
                "process takes a lost rank's place; an elastic troupe train makes it a spare that "
                "replaces a lost rank or lets a shrunk run grow back");
  sub->add_option("--rank-offset", o->rank_offset, "First rank started here (with --coordinator)");
  sub->add_option("--world-size", o->world_size,
                  "Ranks of the whole job when other hosts join (default: -n)");
  sub->add_option("--hostfile", o->hostfile,
                  "Lines \"host slots=N\"; the first host runs the coordinator")
      ->check(CLI::ExistingFile);
  sub->add_option("--host-index", o->host_index,
                  "This host's line in the hostfile (default: by name)");
  sub->add_option("--job", o->job, "Job name shown by troupe ps (default: program-XXXXXX)");
  sub->add_option("--net-device", o->net_device,
                  "UCX network device for cross-host data (default: the device of --bind)");
  sub->add_option("--introspection-bind", o->introspection_bind,
                  "Address of the job's HTTP introspection endpoint (default 127.0.0.1)");
  auto hosts = std::make_shared<std::string>();
  sub->add_option("--introspection-hosts", *hosts,
                  "Host names the endpoint answers besides localhost, 127.0.0.1, [::1] and "
                  "--introspection-bind, comma separated (\"*\": any; default none)");
  sub->add_flag("--pin", o->pin, "Pin local rank i to the i-th CPU (benchmarks)");
  sub->add_option("--grace", o->grace_s,
                  "Seconds the other ranks get after one fails, before SIGTERM")
      ->default_val(30.0);
  sub->add_flag("--quiet", o->quiet, "Only errors from the launcher itself");
  sub->add_flag("--tls", o->use_tls,
                "Control plane (CAF) over TLS between the ranks and the coordinator; needs "
                "--tls-cert and --tls-key");
  sub->add_option("--tls-cert", o->tls.cert, "PEM certificate every process presents (--tls)");
  sub->add_option("--tls-key", o->tls.key, "Its PEM private key, unencrypted (--tls)");
  sub->add_option("--tls-ca", o->tls.ca,
                  "PEM CA certificates peers must chain to (default: the certificate, "
                  "self-signed)");
  sub->add_option("command", o->command, "PROGRAM ARGS (after --)")->required();
  return [sub, o, hosts]() -> int {
    if (!sub->parsed()) return -1;
    for (std::size_t at = 0; !hosts->empty() && at <= hosts->size();) {
      std::size_t comma = std::min(hosts->find(',', at), hosts->size());
      o->introspection_hosts.push_back(hosts->substr(at, comma - at));
      at = comma + 1;
    }
    return actors::launch(*o);
  };
}

}  // namespace troupe::apps
