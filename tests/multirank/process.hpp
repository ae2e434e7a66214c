// A child process for multi-process tests: fork/exec with stdout and stderr captured (merged) by a
// reader thread, so a test can wait for a line, note when it came, signal the process, and reap
// it with a deadline. The destructor kills a process still running: no test leaves orphans.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace troupe::tests {

class child_process {
 public:
  using clock = std::chrono::steady_clock;

  // Starts argv[0] (a path) with the current environment plus `env` ("KEY", "VALUE" pairs).
  explicit child_process(std::vector<std::string> argv,
                         std::vector<std::pair<std::string, std::string>> env = {});
  ~child_process();
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;

  pid_t pid() const { return pid_; }
  // True once a line containing `needle` was printed, false after `timeout`.
  bool wait_for(const std::string& needle, std::chrono::milliseconds timeout);
  // True once `count` lines containing `needle` were printed, false after `timeout`.
  bool wait_for_count(const std::string& needle, int count, std::chrono::milliseconds timeout);
  // When the first line containing `needle` arrived.
  std::optional<clock::time_point> time_of(const std::string& needle) const;
  // Every line containing `needle`.
  std::vector<std::string> lines_with(const std::string& needle) const;
  std::string output() const;

  void signal(int sig);
  // The wait status once it exits; nullopt after `timeout` (then the process is SIGKILLed).
  std::optional<int> wait(std::chrono::milliseconds timeout);
  // True when it still runs after `timeout` (left running, e.g. to look at its threads); false
  // once it exited (then wait() returns its status at once).
  bool running_after(std::chrono::milliseconds timeout);
  // Exit code, or 128 + signal.
  static int code(int status);

 private:
  void read_loop(int fd);

  pid_t pid_ = -1;
  bool reaped_ = false;
  int status_ = 0;
  std::thread reader_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::string partial_;
  std::vector<std::pair<clock::time_point, std::string>> lines_;
};

// Runs a command to its end (for `ip ...`): returns the exit code and the merged output.
std::pair<int, std::string> run_command(const std::vector<std::string>& argv,
                                        std::chrono::milliseconds timeout);

}  // namespace troupe::tests
