// run_local_ranks (see local_ranks.hpp): fork, exchange UCX addresses, supervise, report.
//
// Parent <-> child protocol on one AF_UNIX stream socketpair per child, frames of
// [type: 1 byte][length: 4 bytes][payload]:
//   child -> parent  'A' worker address       'D' int32 body result
//   parent -> child  'S' all addresses        'F' int32 rank + reason: that rank is lost
//                    'X' every rank is done: destroy the transport and exit
#include "collective/ucx/local_ranks.hpp"

#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <thread>

#include "collective/auth.hpp"
#include "memory/error.hpp"

namespace troupe::collective {

namespace {

using clock = std::chrono::steady_clock;

struct frame {
  char type = 0;
  std::vector<std::uint8_t> payload;
};

bool write_all(int fd, const void* data, std::size_t n) {
  auto* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

bool read_all(int fd, void* data, std::size_t n) {
  auto* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t k = read(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<std::size_t>(k);
  }
  return true;
}

bool send_frame(int fd, char type, const void* data, std::size_t n) {
  std::vector<std::uint8_t> buf;
  buf.reserve(5 + n);
  buf.push_back(static_cast<std::uint8_t>(type));
  auto len = static_cast<std::uint32_t>(n);
  auto* lp = reinterpret_cast<const std::uint8_t*>(&len);
  buf.insert(buf.end(), lp, lp + 4);
  auto* dp = static_cast<const std::uint8_t*>(data);
  if (n > 0) buf.insert(buf.end(), dp, dp + n);
  return write_all(fd, buf.data(), buf.size());
}

bool recv_frame(int fd, frame& f) {
  std::uint8_t head[5];
  if (!read_all(fd, head, 5)) return false;
  std::uint32_t len = 0;
  std::memcpy(&len, head + 1, 4);
  if (len > (64u << 20)) return false;
  f.type = static_cast<char>(head[0]);
  f.payload.resize(len);
  return len == 0 || read_all(fd, f.payload.data(), len);
}

std::vector<std::uint8_t> int_payload(std::int32_t v, const std::string& text = {}) {
  std::vector<std::uint8_t> p(4 + text.size());
  std::memcpy(p.data(), &v, 4);
  std::memcpy(p.data() + 4, text.data(), text.size());
  return p;
}

std::int32_t payload_int(const frame& f) {
  std::int32_t v = -1;
  if (f.payload.size() >= 4) std::memcpy(&v, f.payload.data(), 4);
  return v;
}

std::string exit_text(int status) {
  if (WIFSIGNALED(status)) {
    int sig = WTERMSIG(status);
    return "signal " + std::to_string(sig) + " (" + strsignal(sig) + ")";
  }
  return "exit code " + std::to_string(WEXITSTATUS(status));
}

// ---- child ---------------------------------------------------------------------------------

int child_main(int rank, int n, int fd, const std::function<int(ucx_transport&)>& body,
               const local_ranks_options& opt, const std::string& token) {
  ucx_transport_options to;
  to.rank = rank;
  to.size = n;
  to.net_device = opt.net_device;
  to.progress_thread = opt.progress_thread;
  to.error_mode = opt.error_mode;
  to.single_copy = opt.single_copy;
  to.token = token;
  to.job = "local-ranks";
  ucx_transport t(to);
  auto addr = t.address();
  TROUPE_CHECK(send_frame(fd, 'A', addr.data(), addr.size()), "local rank ", rank,
               ": sending the UCX address to the parent failed");
  frame f;
  TROUPE_CHECK(recv_frame(fd, f) && f.type == 'S', "local rank ", rank,
               ": the parent sent no address table");
  std::size_t off = 0;
  for (int p = 0; p < n; ++p) {
    std::uint32_t len = 0;
    TROUPE_CHECK(off + 4 <= f.payload.size(), "local rank ", rank, ": bad address table");
    std::memcpy(&len, f.payload.data() + off, 4);
    off += 4;
    TROUPE_CHECK(off + len <= f.payload.size(), "local rank ", rank, ": bad address table");
    if (p != rank) t.connect(p, std::span<const std::uint8_t>(f.payload.data() + off, len));
    off += len;
  }
  t.authenticate(opt.timeout);

  // The supervisor's messages: lost peers, and the final release.
  std::mutex mu;
  std::condition_variable cv;
  bool released = false;
  std::thread monitor([&] {
    frame m;
    while (recv_frame(fd, m)) {
      if (m.type == 'F') {
        int k = payload_int(m);
        std::string reason(m.payload.begin() + 4, m.payload.end());
        try {
          t.fail_peer(k, reason);
        } catch (const std::exception& e) {
          std::fprintf(stderr, "local rank %d: fail_peer(%d) threw: %s\n", rank, k, e.what());
        }
      } else if (m.type == 'X') {
        break;
      }
    }
    std::lock_guard lk(mu);
    released = true;
    cv.notify_all();
  });

  int code = 1;
  try {
    code = body(t);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "local rank %d: the body threw: %s\n", rank, e.what());
  } catch (...) {
    std::fprintf(stderr, "local rank %d: the body threw a non-standard exception\n", rank);
  }
  auto c = static_cast<std::int32_t>(code);
  if (!send_frame(fd, 'D', &c, 4)) {
    std::fprintf(stderr, "local rank %d: reporting to the parent failed\n", rank);
  }
  {
    std::unique_lock lk(mu);
    cv.wait(lk, [&] { return released; });
  }
  monitor.join();
  return code;
}

[[noreturn]] void run_child(int rank, int n, int fd, pid_t parent,
                            const std::function<int(ucx_transport&)>& body,
                            const local_ranks_options& opt, const std::vector<int>& cpus,
                            const std::string& token) {
  // Die with the parent; no inherited Catch2 signal handlers.
  prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (getppid() != parent) _exit(125);
  for (int sig : {SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL, SIGINT, SIGTERM}) signal(sig, SIG_DFL);
  if (opt.pin_cpus && !cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpus[static_cast<std::size_t>(rank) % cpus.size()], &set);
    if (sched_setaffinity(0, sizeof set, &set) != 0) {
      std::fprintf(stderr, "local rank %d: sched_setaffinity failed: %s\n", rank,
                   std::strerror(errno));
    }
  }
  int code = 1;
  try {
    code = child_main(rank, n, fd, body, opt, token);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "local rank %d: %s\n", rank, e.what());
  } catch (...) {
    std::fprintf(stderr, "local rank %d: unknown exception\n", rank);
  }
  std::fflush(stdout);
  std::fflush(stderr);
  _exit(code & 0xff);
}

// ---- parent --------------------------------------------------------------------------------

struct child {
  pid_t pid = -1;
  int fd = -1;
  bool exited = false;    // reaped
  bool reported = false;  // sent 'D'
  bool released = false;  // got 'X'
  int status = 0;
  rank_outcome outcome;
};

std::vector<int> allowed_cpus() {
  std::vector<int> cpus;
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    for (int c = 0; c < CPU_SETSIZE; ++c) {
      if (CPU_ISSET(c, &set)) cpus.push_back(c);
    }
  }
  return cpus;
}

void tell_survivors(std::vector<child>& kids, int lost, const std::string& reason) {
  auto payload = int_payload(lost, reason);
  for (std::size_t i = 0; i < kids.size(); ++i) {
    if (static_cast<int>(i) == lost || kids[i].exited || kids[i].fd < 0) continue;
    send_frame(kids[i].fd, 'F', payload.data(), payload.size());  // a dead reader is fine
  }
}

}  // namespace

std::string rank_outcome::describe() const {
  std::string s = "rank " + std::to_string(rank);
  if (hung) return s + " hung (killed after the timeout)";
  if (signal != 0) {
    return s + " killed by signal " + std::to_string(signal) + " (" + strsignal(signal) + ")";
  }
  return s + " exited with code " + std::to_string(exit_code);
}

int run_local_ranks(int n, std::function<int(ucx_transport&)> body, local_ranks_options opt) {
  TROUPE_CHECK(n >= 1 && n <= 256, "run_local_ranks: ", n, " ranks (1..256 allowed)");
  std::vector<child> kids(static_cast<std::size_t>(n));
  std::vector<int> child_ends(static_cast<std::size_t>(n), -1);
  auto close_all = [&] {
    for (auto& k : kids) {
      if (k.fd >= 0) close(k.fd);
      k.fd = -1;
    }
    for (int& fd : child_ends) {
      if (fd >= 0) close(fd);
      fd = -1;
    }
  };
  for (int i = 0; i < n; ++i) {
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      int e = errno;
      close_all();
      TROUPE_FAIL("run_local_ranks: socketpair failed: ", std::strerror(e));
    }
    kids[i].fd = sv[0];
    child_ends[i] = sv[1];
    kids[i].outcome.rank = i;
  }
  const std::vector<int> cpus = allowed_cpus();
  const pid_t parent = getpid();
  // The children's job token: fresh per run, inherited by the fork, never sent anywhere.
  std::string token;
  for (std::uint8_t b : auth::fresh_nonce()) {
    static constexpr char hex[] = "0123456789abcdef";
    token += hex[b >> 4];
    token += hex[b & 15];
  }
  std::fflush(stdout);
  std::fflush(stderr);
  for (int i = 0; i < n; ++i) {
    pid_t pid = fork();
    if (pid < 0) {
      int e = errno;
      for (int j = 0; j < i; ++j) kill(kids[j].pid, SIGKILL);
      for (int j = 0; j < i; ++j) waitpid(kids[j].pid, nullptr, 0);
      close_all();
      TROUPE_FAIL("run_local_ranks: fork of rank ", i, " failed: ", std::strerror(e));
    }
    if (pid == 0) {
      for (int j = 0; j < n; ++j) {
        close(kids[j].fd);
        if (j != i) close(child_ends[j]);
      }
      run_child(i, n, child_ends[i], parent, body, opt, cpus, token);
    }
    kids[i].pid = pid;
  }
  for (int& fd : child_ends) {
    close(fd);
    fd = -1;
  }

  const auto deadline = clock::now() + opt.timeout;
  std::vector<std::vector<std::uint8_t>> addresses(static_cast<std::size_t>(n));
  int have_address = 0;
  bool scattered = false;
  bool aborted = false;  // a child died before the addresses were exchanged: kill everyone

  auto reap = [&] {
    for (int i = 0; i < n; ++i) {
      auto& k = kids[i];
      if (k.exited) continue;
      int status = 0;
      pid_t r = waitpid(k.pid, &status, WNOHANG);
      if (r != k.pid) continue;
      k.exited = true;
      k.status = status;
      if (WIFSIGNALED(status)) {
        k.outcome.signal = WTERMSIG(status);
      } else {
        k.outcome.exit_code = WEXITSTATUS(status);
      }
      if (!k.released) {
        // Died before the end: the survivors' transports must give up on it.
        if (!scattered) aborted = true;
        tell_survivors(kids, i, "rank " + std::to_string(i) + " died: " + exit_text(status));
      }
    }
  };

  while (true) {
    reap();
    bool all_exited = true;
    for (auto& k : kids) all_exited = all_exited && k.exited;
    if (all_exited) break;
    if (aborted || clock::now() >= deadline) {
      bool timed_out = !aborted;
      for (auto& k : kids) {
        if (k.exited) continue;
        kill(k.pid, SIGKILL);
        if (timed_out) k.outcome.hung = true;
      }
      for (auto& k : kids) {
        if (k.exited) continue;
        int status = 0;
        waitpid(k.pid, &status, 0);
        k.exited = true;
        if (WIFSIGNALED(status)) {
          k.outcome.signal = WTERMSIG(status);
        } else {
          k.outcome.exit_code = WEXITSTATUS(status);
        }
      }
      break;
    }
    // Messages from the children.
    std::vector<pollfd> pfds;
    std::vector<int> who;
    for (int i = 0; i < n; ++i) {
      if (kids[i].fd >= 0 && !kids[i].released) {
        pfds.push_back({kids[i].fd, POLLIN, 0});
        who.push_back(i);
      }
    }
    int ready = pfds.empty() ? 0 : poll(pfds.data(), pfds.size(), 20);
    if (pfds.empty()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (std::size_t j = 0; ready > 0 && j < pfds.size(); ++j) {
      if (pfds[j].revents == 0) continue;
      int i = who[j];
      auto& k = kids[i];
      frame f;
      if (!recv_frame(k.fd, f)) {  // EOF: the child is dying; waitpid tells how
        close(k.fd);
        k.fd = -1;
        continue;
      }
      if (f.type == 'A' && addresses[i].empty()) {
        addresses[i] = std::move(f.payload);
        ++have_address;
      } else if (f.type == 'D') {
        k.reported = true;
        int code = payload_int(f);
        if (code != 0) {
          tell_survivors(
              kids, i,
              "rank " + std::to_string(i) + " failed: its body returned " + std::to_string(code));
        }
      }
    }
    if (!scattered && have_address == n) {
      std::vector<std::uint8_t> table;
      for (auto& a : addresses) {
        auto len = static_cast<std::uint32_t>(a.size());
        auto* lp = reinterpret_cast<const std::uint8_t*>(&len);
        table.insert(table.end(), lp, lp + 4);
        table.insert(table.end(), a.begin(), a.end());
      }
      for (auto& k : kids) {
        if (k.fd >= 0) send_frame(k.fd, 'S', table.data(), table.size());
      }
      scattered = true;
    }
    // Release everyone once every child has finished its body or died.
    bool all_done = true;
    for (auto& k : kids) all_done = all_done && (k.reported || k.exited);
    if (scattered && all_done) {
      for (auto& k : kids) {
        if (!k.exited && !k.released && k.fd >= 0) send_frame(k.fd, 'X', nullptr, 0);
        k.released = true;
      }
    }
  }
  close_all();

  int failed = 0;
  for (auto& k : kids) {
    if (!k.outcome.ok()) {
      ++failed;
      std::fprintf(stderr, "run_local_ranks: %s\n", k.outcome.describe().c_str());
    }
  }
  if (opt.outcomes != nullptr) {
    opt.outcomes->clear();
    for (auto& k : kids) opt.outcomes->push_back(k.outcome);
  }
  return failed == 0 ? 0 : 1;
}

}  // namespace troupe::collective
