// The launcher: coordinator + fork/exec of local ranks, line-prefixed output, failure report.
#include "actors/launcher.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "actors/bootstrap.hpp"
#include "actors/coordinator.hpp"
#include "actors/shutdown_watch.hpp"
#include "memory/error.hpp"

extern char** environ;

namespace troupe::actors {
namespace {

using steady = std::chrono::steady_clock;

volatile sig_atomic_t g_signal = 0;
int g_wake[2] = {-1, -1};

void on_signal(int s) {
  g_signal = s;
  if (g_wake[1] >= 0) {
    const char c = 's';
    [[maybe_unused]] ssize_t n = ::write(g_wake[1], &c, 1);
  }
}

void write_all(int fd, std::string_view s) {
  while (!s.empty()) {
    const ssize_t n = ::write(fd, s.data(), s.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;  // the terminal went away: nothing sensible left to do with the output
    }
    s.remove_prefix(static_cast<std::size_t>(n));
  }
}

void say(const std::string& line) {
  write_all(2, "troupe launch: " + line + "\n");
}

struct stream {
  int fd = -1;
  int out = 1;  // where its lines go
  std::string partial;
};

struct child {
  int local = 0, rank = 0;
  pid_t pid = -1;
  stream out, err;
  bool running = true;
  int status = 0;
  bool taken_over = false;  // it failed and a joiner took its rank's place
};

// "rank 3", or "joiner 0" for a joiner (troupe launch --join) whose rank the coordinator gives.
std::string name_of(const child& c) {
  return c.rank < 0 ? "joiner " + std::to_string(c.local) : "rank " + std::to_string(c.rank);
}

std::string resolve_program(const std::string& p) {
  if (p.find('/') != std::string::npos) {
    TROUPE_CHECK(::access(p.c_str(), X_OK) == 0, "troupe launch: cannot run ", p, ": ",
                 std::strerror(errno));
    return p;
  }
  const char* path = std::getenv("PATH");
  std::string dirs = path ? path : "/usr/bin:/bin";
  std::size_t start = 0;
  while (start <= dirs.size()) {
    const auto colon = dirs.find(':', start);
    const std::size_t len = colon == std::string::npos ? dirs.size() - start : colon - start;
    std::string full = len == 0 ? std::string("./") : dirs.substr(start, len) + "/";
    full += p;
    struct stat st {};
    if (::stat(full.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(full.c_str(), X_OK) == 0)
      return full;
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  TROUPE_FAIL("troupe launch: cannot run ", p, ": not found in PATH");
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int s = WTERMSIG(status);
    const char* name = ::strsignal(s);
    return "was killed by signal " + std::to_string(s) +
           (name ? std::string(" (") + name + ")" : "");
  }
  return "ended with status " + std::to_string(status);
}

bool failed(int status) {
  return !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

std::string job_name_for(const std::string& program) {
  std::string base = program.substr(program.find_last_of('/') + 1);
  std::string clean;
  for (char c : base)
    clean += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') ? c : '_';
  if (clean.empty() || clean[0] == '.') clean = "job";
  if (clean.size() > 40) clean.resize(40);
  return clean + "-" + generate_token().substr(0, 6);
}

// Moves whole lines from `s` (and, at EOF, the rest) to its output, prefixed.
void flush_lines(stream& s, const std::string& prefix, bool eof) {
  std::size_t start = 0;
  for (;;) {
    const auto nl = s.partial.find('\n', start);
    if (nl == std::string::npos) break;
    write_all(s.out, prefix + s.partial.substr(start, nl - start + 1));
    start = nl + 1;
  }
  s.partial.erase(0, start);
  if (eof && !s.partial.empty()) {
    write_all(s.out, prefix + s.partial + "\n");
    s.partial.clear();
  }
}

// The CPUs this process may run on, in order.
std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0)
    for (int c = 0; c < CPU_SETSIZE; ++c)
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
  if (cpus.empty()) cpus.push_back(0);
  return cpus;
}

}  // namespace

int launch(const launch_options& given) {
  launch_options o = given;
  TROUPE_CHECK(!o.command.empty(),
               "troupe launch: no program given (troupe launch -n N -- PROGRAM ARGS)");
  TROUPE_CHECK(o.heartbeat_timeout_s >= 0.05, "troupe launch: --heartbeat-timeout ",
               o.heartbeat_timeout_s, " is below 0.05 s");
  TROUPE_CHECK(o.port >= 0 && o.port <= 65535, "troupe launch: --port ", o.port, " is not a port");

  // Hostfile: this host's block of ranks and the coordinator on the first host.
  bool host_coordinator = o.coordinator.empty();
  if (!o.hostfile.empty()) {
    TROUPE_CHECK(o.coordinator.empty(),
                 "troupe launch: give --hostfile or --coordinator, not both");
    auto hosts = read_hostfile(o.hostfile);
    if (!hosts) TROUPE_FAIL("troupe launch: ", hosts.error_message());
    int index = o.host_index;
    if (index < 0) {
      auto found = find_host_index(*hosts);
      if (!found)
        TROUPE_FAIL("troupe launch: --hostfile ", o.hostfile, ": ", found.error_message());
      index = *found;
    }
    TROUPE_CHECK(index < static_cast<int>(hosts->size()), "troupe launch: --host-index ", index,
                 " but ", o.hostfile, " lists ", hosts->size(), " hosts");
    int offset = 0, world = 0;
    for (int i = 0; i < static_cast<int>(hosts->size()); ++i) {
      if (i < index) offset += (*hosts)[i].slots;
      world += (*hosts)[i].slots;
    }
    const int slots = (*hosts)[index].slots;
    TROUPE_CHECK(o.nprocs == 0 || o.nprocs == slots, "troupe launch: -n ", o.nprocs, " but ",
                 o.hostfile, " gives this host (", (*hosts)[index].host, ") ", slots, " slots");
    o.nprocs = slots;
    o.rank_offset = offset;
    TROUPE_CHECK(o.world_size == 0 || o.world_size == world, "troupe launch: --world-size ",
                 o.world_size, " but ", o.hostfile, " has ", world, " slots in all");
    o.world_size = world;
    if (o.port == 0) o.port = default_coordinator_port;
    host_coordinator = index == 0;
    if (!host_coordinator) o.coordinator = (*hosts)[0].host + ":" + std::to_string(o.port);
    TROUPE_CHECK(hosts->size() == 1 || !o.bind.empty(), "troupe launch: ", o.hostfile, " names ",
                 hosts->size(),
                 " hosts: give --bind with an address of this host the others reach");
  }
  if (o.join) {
    // Joiners: processes that take lost ranks' places in a running job (the coordinator gives
    // each its rank); no world, offsets or spares of their own.
    TROUPE_CHECK(!o.coordinator.empty() && o.hostfile.empty(),
                 "troupe launch: --join needs --coordinator HOST:PORT of the running job");
    TROUPE_CHECK(o.rank_offset == 0 && o.world_size == 0 && o.spares == 0 && o.min_ranks == 0,
                 "troupe launch: --join takes no --rank-offset, --world-size, --spares or "
                 "--min-ranks: the coordinator gives each joiner a lost rank's place");
    if (o.nprocs == 0) o.nprocs = 1;
  }
  TROUPE_CHECK(o.nprocs > 0, "troupe launch: -n must be positive (got ", o.nprocs, ")");
  TROUPE_CHECK(o.spares >= 0, "troupe launch: --spares must not be negative (got ", o.spares, ")");
  if (o.spares > 0) {
    TROUPE_CHECK(o.hostfile.empty() && host_coordinator && o.world_size == 0,
                 "troupe launch: --spares ", o.spares,
                 " works for a job on one host (no --hostfile, --coordinator or --world-size)");
    o.nprocs += o.spares;
  }
  TROUPE_CHECK(o.min_ranks >= 0 && o.min_ranks <= o.nprocs, "troupe launch: --min-ranks ",
               o.min_ranks, " must be 0 (no shrinking) to the ", o.nprocs, " ranks started");
  TROUPE_CHECK(o.min_ranks == 0 || (o.hostfile.empty() && host_coordinator && o.world_size == 0),
               "troupe launch: --min-ranks ", o.min_ranks,
               " works for a job on one host (no --hostfile, --coordinator or --world-size)");
  // --spares and --min-ranks: this many rank failures leave the others running.
  const int tolerated_failures = std::max(o.spares, o.min_ranks > 0 ? o.nprocs - o.min_ranks : 0);
  const std::string tolerated_by =
      o.min_ranks > 0 ? "--spares and --min-ranks allow" : "--spares allows";
  TROUPE_CHECK(o.rank_offset >= 0, "troupe launch: --rank-offset must not be negative");
  if (host_coordinator) {
    TROUPE_CHECK(
        o.rank_offset == 0 || !o.hostfile.empty(),
        "troupe launch: --rank-offset needs --coordinator (ranks of another launcher's job)");
    if (o.world_size == 0) o.world_size = o.nprocs;
  }
  TROUPE_CHECK(o.world_size == 0 || o.rank_offset + o.nprocs <= o.world_size,
               "troupe launch: ranks ", o.rank_offset, "..", o.rank_offset + o.nprocs - 1,
               " do not fit a world of ", o.world_size);

  // The token: given, from a file, or fresh (only where the coordinator runs).
  bool generated = false;
  TROUPE_CHECK(o.token.empty() || o.token_file.empty(),
               "troupe launch: give --token or --token-file, not both");
  if (!o.token_file.empty()) {
    auto t = read_token_file(o.token_file);
    if (!t) TROUPE_FAIL("troupe launch: --token-file: ", t.error_message());
    o.token = *t;
  }
  if (o.token.empty()) {
    TROUPE_CHECK(host_coordinator, "troupe launch: joining coordinator ", o.coordinator,
                 " needs the job's token: give --token or --token-file");
    o.token = generate_token();
    generated = true;
  }

  for (const auto& h : o.introspection_hosts)
    TROUPE_CHECK(!h.empty() && h.find_first_of(" /\t") == std::string::npos &&
                     (h.front() == '[' || h.find(':') == std::string::npos),
                 "troupe launch: --introspection-hosts: '", h,
                 "' is not a host name (give names or addresses without a port, IPv6 in [])");
  // TLS: refused up front, naming the flag and the file, rather than at every rank's handshake.
  if (o.use_tls) {
    o.tls = absolute_tls_paths(o.tls);
    check_tls(o.tls, tls_source::flags);
  } else {
    TROUPE_CHECK(!o.tls.enabled(), "troupe launch: ",
                 !o.tls.cert.empty()  ? "--tls-cert"
                 : !o.tls.key.empty() ? "--tls-key"
                                      : "--tls-ca",
                 " is given without --tls: add --tls for a TLS control plane");
  }

  const std::string program = resolve_program(o.command[0]);
  if (o.job.empty()) o.job = job_name_for(program);
  const std::string bind = o.bind.empty() ? std::string("127.0.0.1") : o.bind;
  const bool wildcard = bind == "0.0.0.0" || bind == "::";
  std::string net_device = o.net_device.empty() ? net_device_for(bind) : o.net_device;

  std::unique_ptr<coordinator> coord;
  std::string coordinator_address = o.coordinator;
  if (host_coordinator) {
    coordinator_options co;
    co.job = o.job;
    co.token = o.token;
    co.world_size = o.world_size;
    co.bind = bind;
    co.port = static_cast<std::uint16_t>(o.port);
    if (!o.introspection_bind.empty()) co.http_bind = o.introspection_bind;
    co.http_allowed_hosts = o.introspection_hosts;
    if (o.use_tls) co.tls = o.tls;
    co.heartbeat_timeout =
        std::chrono::milliseconds(static_cast<std::int64_t>(o.heartbeat_timeout_s * 1000.0 + 0.5));
    if (o.quiet)
      co.log = [](const std::string& line) {
        if (line.find(" joined (") == std::string::npos &&
            line.find("joined and connected") == std::string::npos)
          write_all(2, "troupe coordinator: " + line + "\n");
      };
    coord = std::make_unique<coordinator>(co);
    coordinator_address =
        (wildcard ? std::string("127.0.0.1") : bind) + ":" + std::to_string(coord->port());
    if (!o.quiet) {
      say("job " + o.job + ": coordinator on " + bind + ":" + std::to_string(coord->port()) +
          (o.use_tls ? " (TLS)" : "") +
          (coord->http_endpoint().empty()
               ? std::string()
               : ", introspection http://" + coord->http_endpoint() + "/") +
          ", " + std::to_string(o.nprocs) + " of " + std::to_string(o.world_size) + " ranks here");
      if (o.world_size > o.nprocs)
        say("other hosts join with: troupe launch -n M --coordinator " +
            (wildcard ? this_host() : bind) + ":" + std::to_string(coord->port()) +
            " --rank-offset R --token" + (generated ? " " + o.token : "-file F") +
            (o.use_tls ? " --tls --tls-cert C --tls-key K --tls-ca A" : "") + " -- ...");
    }
  }

  // The environment of every rank: ours without stale TROUPE_* variables (an outer job's
  // coordinator, token, rank...), plus the job's. The user's machine-wide settings pass through:
  // the kernel choices of README's Environment section.
  static constexpr const char* user_settings[] = {"TROUPE_KEEP_OPENBLAS_CORETYPE=",
                                                  "TROUPE_NUM_THREADS="};
  std::vector<std::string> base_env;
  for (char** e = environ; e && *e; ++e) {
    bool keep = std::strncmp(*e, "TROUPE_", 7) != 0;
    for (const char* u : user_settings) keep = keep || std::strncmp(*e, u, std::strlen(u)) == 0;
    if (keep) base_env.emplace_back(*e);
  }
  base_env.push_back("TROUPE_COORDINATOR=" + coordinator_address);
  base_env.push_back("TROUPE_TOKEN=" + o.token);
  base_env.push_back("TROUPE_JOB=" + o.job);
  base_env.push_back("TROUPE_BIND=" + bind);
  if (!net_device.empty()) base_env.push_back("TROUPE_NET_DEVICE=" + net_device);
  if (o.world_size > 0) base_env.push_back("TROUPE_WORLD_SIZE=" + std::to_string(o.world_size));
  if (o.spares > 0) base_env.push_back("TROUPE_SPARES=" + std::to_string(o.spares));
  if (o.min_ranks > 0) base_env.push_back("TROUPE_MIN_RANKS=" + std::to_string(o.min_ranks));
  if (o.use_tls) {
    base_env.push_back("TROUPE_TLS_CERT=" + o.tls.cert);
    base_env.push_back("TROUPE_TLS_KEY=" + o.tls.key);
    if (!o.tls.ca.empty()) base_env.push_back("TROUPE_TLS_CA=" + o.tls.ca);
  }
  for (const auto& [k, v] : o.env) base_env.push_back(k + "=" + v);

  // Signals: forwarded to the ranks; the self-pipe wakes the poll loop.
  TROUPE_CHECK(::pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) == 0,
               "troupe launch: pipe2: ", std::strerror(errno));
  struct sigaction sa {
  }, old_int{}, old_term{}, old_hup{};
  sa.sa_handler = on_signal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, &old_int);
  ::sigaction(SIGTERM, &sa, &old_term);
  ::sigaction(SIGHUP, &sa, &old_hup);
  g_signal = 0;

  const std::vector<int> cpus = allowed_cpus();
  std::vector<child> children(static_cast<std::size_t>(o.nprocs));
  const pid_t parent = ::getpid();
  std::string spawn_error;
  for (int i = 0; i < o.nprocs; ++i) {
    child& c = children[i];
    c.local = i;
    c.rank = o.rank_offset + i;
    int out[2], err[2];
    if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
      spawn_error = std::string("pipe2: ") + std::strerror(errno);
      c.running = false;
      break;
    }
    std::vector<std::string> env = base_env;
    if (o.join) {
      c.rank = -1;  // given by the coordinator
      env.push_back("TROUPE_JOIN=1");
    } else {
      env.push_back("TROUPE_RANK=" + std::to_string(c.rank));
    }
    env.push_back("TROUPE_LOCAL_RANK=" + std::to_string(i));
    std::vector<char*> envp, argv;
    for (auto& s : env) envp.push_back(s.data());
    envp.push_back(nullptr);
    std::vector<std::string> args = o.command;
    for (auto& s : args) argv.push_back(s.data());
    argv.push_back(nullptr);
    const int cpu = cpus[static_cast<std::size_t>(i) % cpus.size()];
    const pid_t pid = ::fork();
    if (pid < 0) {
      spawn_error = std::string("fork: ") + std::strerror(errno);
      ::close(out[0]);
      ::close(out[1]);
      ::close(err[0]);
      ::close(err[1]);
      c.running = false;
      break;
    }
    if (pid == 0) {
      // The child: only async-signal-safe calls until exec.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(127);
      ::dup2(out[1], 1);
      ::dup2(err[1], 2);
      struct sigaction dfl {};
      dfl.sa_handler = SIG_DFL;
      ::sigaction(SIGINT, &dfl, nullptr);
      ::sigaction(SIGTERM, &dfl, nullptr);
      ::sigaction(SIGHUP, &dfl, nullptr);
      if (o.pin) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpu, &set);
        ::sched_setaffinity(0, sizeof set, &set);
      }
      ::execve(program.c_str(), argv.data(), envp.data());
      const char* msg = "troupe launch: exec failed: ";
      [[maybe_unused]] ssize_t n = ::write(2, msg, std::strlen(msg));
      const char* why = std::strerror(errno);
      n = ::write(2, why, std::strlen(why));
      n = ::write(2, "\n", 1);
      ::_exit(127);
    }
    ::close(out[1]);
    ::close(err[1]);
    c.pid = pid;
    c.out.fd = out[0];
    c.out.out = 1;
    c.err.fd = err[0];
    c.err.out = 2;
    if (o.on_start) o.on_start(i, c.rank, static_cast<int>(pid));
  }
  if (!spawn_error.empty()) {
    say("could not start every rank: " + spawn_error);
    for (auto& c : children)
      if (c.pid > 0) ::kill(c.pid, SIGTERM);
  }

  // Relay output and reap ranks until every rank is gone and its pipes are drained.
  std::vector<int> failures;   // local indices, in the order they failed
  bool driver_failed = false;  // rank 0 (the elastic driver) failed: never tolerated
  steady::time_point first_failure{}, term_sent{};
  // After a rank ended well while no rank failed, the ranks still running are named 10 s later,
  // then every 60 s: a rank that hangs in its shutdown shows in the output (with its own
  // "shutdown still ..." lines). After a failure the grace period and its messages take over.
  steady::time_point first_good_end{}, next_lingering_report{};
  constexpr auto lingering_first = std::chrono::seconds(10);
  constexpr auto lingering_every = std::chrono::seconds(60);
  bool terminating = false, killed = false;
  int signals_seen = 0;
  char buf[65536];
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<stream*> streams;
    std::vector<const child*> owners;
    for (auto& c : children)
      for (stream* s : {&c.out, &c.err})
        if (s->fd >= 0) {
          fds.push_back(pollfd{s->fd, POLLIN, 0});
          streams.push_back(s);
          owners.push_back(&c);
        }
    bool any_running = false;
    for (const auto& c : children) any_running = any_running || (c.pid > 0 && c.running);
    if (fds.empty() && !any_running) break;
    fds.push_back(pollfd{g_wake[0], POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), 100);
    if (n < 0 && errno != EINTR) {
      say(std::string("poll: ") + std::strerror(errno));
      break;
    }
    for (std::size_t i = 0; i + 1 < fds.size(); ++i) {
      if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      stream& s = *streams[i];
      const std::string prefix = !o.prefix ? std::string()
                                 : owners[i]->rank < 0
                                     ? "[joiner " + std::to_string(owners[i]->local) + "] "
                                     : "[rank " + std::to_string(owners[i]->rank) + "] ";
      const ssize_t got = ::read(s.fd, buf, sizeof buf);
      if (got > 0) {
        s.partial.append(buf, static_cast<std::size_t>(got));
        flush_lines(s, prefix, false);
      } else if (got == 0 || (errno != EINTR && errno != EAGAIN)) {
        flush_lines(s, prefix, true);
        ::close(s.fd);
        s.fd = -1;
      }
    }
    if (fds.back().revents & POLLIN) {
      char drain[64];
      while (::read(g_wake[0], drain, sizeof drain) > 0) {
      }
    }
    // Reap.
    for (auto& c : children) {
      if (c.pid <= 0 || !c.running) continue;
      int status = 0;
      const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      if (r == c.pid) {
        c.running = false;
        c.status = status;
        if (first_good_end == steady::time_point{} && !failed(status)) {
          first_good_end = steady::now();
          next_lingering_report = first_good_end + lingering_first;
        }
        if (coord) coord->process_ended(c.rank, static_cast<int>(c.pid), describe_status(status));
        if (failed(status)) {
          failures.push_back(c.local);
          // --spares: that many failures leave the others running (an elastic run replaces them).
          // Rank 0 runs the elastic driver: its failure ends the job whatever the others allow.
          const bool was_driver = c.rank == 0 && !driver_failed;
          driver_failed = driver_failed || c.rank == 0;
          const bool tolerated =
              failures.size() <= static_cast<std::size_t>(tolerated_failures) && !driver_failed;
          if (failures.size() == static_cast<std::size_t>(tolerated_failures) + 1 ||
              (was_driver && failures.size() <= static_cast<std::size_t>(tolerated_failures)))
            first_failure = steady::now();
          if (!terminating)
            say(name_of(c) + " (pid " + std::to_string(c.pid) + ") " + describe_status(status) +
                (tolerated
                     ? "; the job goes on (" + std::to_string(failures.size()) + " of " +
                           std::to_string(tolerated_failures) + " failures " + tolerated_by + ")"
                     : std::string()));
        }
      }
    }
    // A failed rank whose place a joiner took (troupe launch --join) is not the job's failure.
    if (coord)
      std::erase_if(failures, [&](int local) {
        child& c = children[static_cast<std::size_t>(local)];
        if (c.rank == 0 || !coord->taken_over(c.rank, static_cast<int>(c.pid))) return false;
        c.taken_over = true;
        if (!terminating)
          say("rank " + std::to_string(c.rank) + " (pid " + std::to_string(c.pid) +
              "): a new process (a joiner) took its place; the job goes on");
        return true;
      });
    // Signals to the launcher go to every rank: SIGTERM first, SIGKILL on the second.
    if (g_signal != 0) {
      const int s = g_signal;
      g_signal = 0;
      ++signals_seen;
      const int fwd = signals_seen == 1 ? SIGTERM : SIGKILL;
      say(std::string("got signal ") + std::to_string(s) + ": sending " +
          (fwd == SIGTERM ? "SIGTERM" : "SIGKILL") + " to the ranks");
      for (auto& c : children)
        if (c.pid > 0 && c.running) ::kill(c.pid, fwd);
      terminating = true;
      term_sent = steady::now();
    }
    // After a failure the others get the grace period, then SIGTERM, then SIGKILL.
    const auto now = steady::now();
    if (first_good_end != steady::time_point{} &&
        failures.size() <= static_cast<std::size_t>(tolerated_failures) && !driver_failed &&
        !terminating && now >= next_lingering_report) {
      std::string running;
      for (const auto& c : children)
        if (c.pid > 0 && c.running)
          running +=
              (running.empty() ? "" : ", ") + (name_of(c) + " (pid " + std::to_string(c.pid) + ")");
      if (!running.empty())
        say("still running " +
            std::to_string(
                std::chrono::duration_cast<std::chrono::seconds>(now - first_good_end).count()) +
            " s after a rank ended well: " + running);
      next_lingering_report = now + lingering_every;
    }
    if ((failures.size() > static_cast<std::size_t>(tolerated_failures) || driver_failed) &&
        !terminating && now - first_failure > std::chrono::duration<double>(o.grace_s)) {
      bool any = false;
      for (auto& c : children)
        if (c.pid > 0 && c.running) {
          ::kill(c.pid, SIGTERM);
          any = true;
        }
      if (any)
        say("stopping the remaining ranks (a rank failed " + std::to_string(o.grace_s) + " s ago)");
      terminating = true;
      term_sent = now;
    }
    if (terminating && !killed && now - term_sent > std::chrono::seconds(5)) {
      for (auto& c : children)
        if (c.pid > 0 && c.running) ::kill(c.pid, SIGKILL);
      killed = true;
    }
  }

  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  ::sigaction(SIGHUP, &old_hup, nullptr);
  ::close(g_wake[0]);
  ::close(g_wake[1]);
  g_wake[0] = g_wake[1] = -1;
  if (coord) {
    detail::shutdown_watch watch(
        "troupe launch",
        "stopping the coordinator (its introspection endpoint and CAF actor system)",
        std::chrono::seconds(10));
    coord.reset();
  }

  std::string report;
  int bad = 0;
  for (const auto& c : children) {
    if (c.pid <= 0) {
      report += (report.empty() ? "" : "; ") + (name_of(c) + " was not started");
      ++bad;
    } else if (failed(c.status) && c.taken_over) {
      say("rank " + std::to_string(c.rank) + " (pid " + std::to_string(c.pid) + ") " +
          describe_status(c.status) + "; a new process (a joiner) took its place");
    } else if (failed(c.status)) {
      report += (report.empty() ? "" : "; ") + (name_of(c) + " " + describe_status(c.status));
      ++bad;
    }
  }
  if (bad == 0) return 0;
  std::string ranks;
  bool all_started = true;
  for (const auto& c : children) all_started = all_started && c.pid > 0;
  if (all_started && bad <= tolerated_failures && !driver_failed && !terminating) {
    say(report + "; every other rank ended well, within the " + std::to_string(tolerated_failures) +
        " failures " + tolerated_by);
    return 0;
  }
  for (const auto& c : children)
    if (c.pid <= 0 || (failed(c.status) && !c.taken_over))
      ranks += (ranks.empty() ? "" : ", ") + (c.rank < 0 ? name_of(c) : std::to_string(c.rank));
  say(std::to_string(bad) + " of " + std::to_string(o.nprocs) + " ranks failed (" +
      (bad == 1 ? "rank " : "ranks ") + ranks + "): " + report);
  return 1;
}

}  // namespace troupe::actors
