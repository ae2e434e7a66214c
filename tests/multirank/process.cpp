// child_process: fork/exec, captured output, signals and reaping for the multi-process tests.
#include "tests/multirank/process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>

extern char** environ;

namespace troupe::tests {

child_process::child_process(std::vector<std::string> argv,
                             std::vector<std::pair<std::string, std::string>> env) {
  int p[2];
  if (::pipe2(p, O_CLOEXEC) != 0)
    throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
  std::vector<std::string> envs;
  for (char** e = environ; e && *e; ++e) {
    std::string s = *e;
    bool replaced = false;
    for (const auto& [k, v] : env)
      if (s.rfind(k + "=", 0) == 0) replaced = true;
    if (!replaced) envs.push_back(s);
  }
  for (const auto& [k, v] : env) envs.push_back(k + "=" + v);
  std::vector<char*> a, e;
  for (auto& s : argv) a.push_back(s.data());
  a.push_back(nullptr);
  for (auto& s : envs) e.push_back(s.data());
  e.push_back(nullptr);
  const pid_t parent = ::getpid();
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error(std::string("fork: ") + std::strerror(errno));
  if (pid_ == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::setpgid(0, 0);  // its own process group: signals to the test runner stay there
    ::dup2(p[1], 1);
    ::dup2(p[1], 2);
    ::execve(a[0], a.data(), e.data());
    const char* msg = "child_process: exec failed\n";
    [[maybe_unused]] ssize_t n = ::write(2, msg, std::strlen(msg));
    ::_exit(127);
  }
  ::close(p[1]);
  reader_ = std::thread([this, fd = p[0]] { read_loop(fd); });
}

child_process::~child_process() {
  if (!reaped_ && pid_ > 0) {
    ::kill(pid_, SIGKILL);
    int st = 0;
    ::waitpid(pid_, &st, 0);
  }
  if (reader_.joinable()) reader_.join();
}

void child_process::read_loop(int fd) {
  char buf[8192];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (n <= 0) {
      if (!partial_.empty()) lines_.emplace_back(clock::now(), partial_);
      partial_.clear();
      cv_.notify_all();
      break;
    }
    partial_.append(buf, static_cast<std::size_t>(n));
    std::size_t start = 0;
    for (;;) {
      const auto nl = partial_.find('\n', start);
      if (nl == std::string::npos) break;
      lines_.emplace_back(clock::now(), partial_.substr(start, nl - start));
      start = nl + 1;
    }
    partial_.erase(0, start);
    cv_.notify_all();
  }
  ::close(fd);
}

bool child_process::wait_for(const std::string& needle, std::chrono::milliseconds timeout) {
  return wait_for_count(needle, 1, timeout);
}

bool child_process::wait_for_count(const std::string& needle, int count,
                                   std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] {
    int c = 0;
    for (const auto& [t, l] : lines_)
      if (l.find(needle) != std::string::npos) ++c;
    return c >= count;
  });
}

std::optional<child_process::clock::time_point> child_process::time_of(
    const std::string& needle) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [t, l] : lines_)
    if (l.find(needle) != std::string::npos) return t;
  return std::nullopt;
}

std::vector<std::string> child_process::lines_with(const std::string& needle) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> out;
  for (const auto& [t, l] : lines_)
    if (l.find(needle) != std::string::npos) out.push_back(l);
  return out;
}

std::string child_process::output() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string s;
  for (const auto& [t, l] : lines_) s += l + "\n";
  return s + partial_;
}

void child_process::signal(int sig) {
  if (!reaped_ && pid_ > 0) ::kill(pid_, sig);
}

std::optional<int> child_process::wait(std::chrono::milliseconds timeout) {
  if (!running_after(timeout)) return status_;
  int st = 0;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, &st, 0);
  reaped_ = true;
  status_ = st;
  if (reader_.joinable()) reader_.join();
  return std::nullopt;
}

bool child_process::running_after(std::chrono::milliseconds timeout) {
  if (reaped_) return false;
  // The exit is an event: a pidfd turns readable when the process ends (Linux 5.3). Without one
  // (an older kernel) the wait falls back to checking every 10 ms.
  const int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid_, 0));
  const auto deadline = clock::now() + timeout;
  bool running = true;
  for (;;) {
    int st = 0;
    if (::waitpid(pid_, &st, WNOHANG) == pid_) {
      reaped_ = true;
      status_ = st;
      if (reader_.joinable()) reader_.join();
      running = false;
      break;
    }
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - clock::now());
    if (left.count() <= 0) break;
    if (pidfd >= 0) {
      pollfd p{pidfd, POLLIN, 0};
      ::poll(&p, 1, static_cast<int>(std::min<long long>(left.count(), 1 << 30)));
    } else {
      std::this_thread::sleep_for(std::min(left, std::chrono::milliseconds(10)));
    }
  }
  if (pidfd >= 0) ::close(pidfd);
  return running;
}

int child_process::code(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return -1;
}

std::pair<int, std::string> run_command(const std::vector<std::string>& argv,
                                        std::chrono::milliseconds timeout) {
  child_process p(argv);
  auto st = p.wait(timeout);
  return {st ? child_process::code(*st) : -1, p.output()};
}

}  // namespace troupe::tests
