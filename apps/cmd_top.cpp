// troupe top: `troupe ps` redrawn every interval, with traffic rates, until Ctrl-C or the job ends.
#include <signal.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>
#include <optional>
#include <thread>

#include "actors/introspection/http_client.hpp"
#include "actors/introspection/job_registry.hpp"
#include "actors/introspection/render.hpp"
#include "apps/commands.hpp"

namespace troupe::apps {
namespace {
using namespace troupe::actors;
using clock = std::chrono::steady_clock;

struct top_args {
  std::string job, endpoint;
  double interval_s = 1;
  int iterations = 0;  // 0: until Ctrl-C or the job ends
  double timeout_s = 3;
  int width = -1;  // -1: the terminal's, or no limit when not a terminal
};

volatile sig_atomic_t stop_requested = 0;
void on_signal(int) {
  stop_requested = 1;
}

// Installs SIGINT/SIGTERM handlers for the life of the object.
struct signal_scope {
  struct sigaction old_int {
  }, old_term{};
  signal_scope() {
    struct sigaction sa {};
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, &old_int);
    sigaction(SIGTERM, &sa, &old_term);
  }
  ~signal_scope() {
    sigaction(SIGINT, &old_int, nullptr);
    sigaction(SIGTERM, &old_term, nullptr);
  }
};

// The last `rows - 1` lines at most, so the header stays on screen.
std::string fit_height(const std::string& text, int rows) {
  if (rows <= 1) return text;
  std::size_t lines = 0, pos = 0;
  while (pos < text.size()) {
    std::size_t nl = text.find('\n', pos);
    if (nl == std::string::npos) break;
    if (++lines == std::size_t(rows - 1)) return text.substr(0, nl + 1);
    pos = nl + 1;
  }
  return text;
}

int run_top(const top_args& a) {
  std::string name = a.job, endpoint = a.endpoint;
  bool from_registry = endpoint.empty();
  if (from_registry) {
    auto job = find_job(list_jobs(), a.job);
    if (!job) {
      std::fprintf(stderr, "troupe top: %s\n", job.error_message().c_str());
      return 1;
    }
    name = job->job;
    endpoint = job->endpoint;
  }
  auto ep = parse_endpoint(endpoint);
  if (!ep) {
    std::fprintf(stderr, "troupe top: %s\n", ep.error_message().c_str());
    return 1;
  }
  const bool tty = isatty(STDOUT_FILENO);
  const auto timeout = std::chrono::milliseconds(static_cast<long long>(a.timeout_s * 1000));
  const auto interval = std::chrono::milliseconds(static_cast<long long>(a.interval_s * 1000));
  signal_scope signals;
  std::optional<job_snapshot> previous;
  clock::time_point previous_at{};
  int failures = 0;
  for (int frame = 0; a.iterations == 0 || frame < a.iterations; ++frame) {
    auto started = clock::now();
    auto snap = fetch_snapshot(ep->first, ep->second, timeout);
    std::string body;
    if (!snap) {
      if (!previous) {  // never reached it: an error, not an ending
        std::fprintf(stderr, "troupe top: %s\n", snap.error_message().c_str());
        return 1;
      }
      bool gone = ++failures >= 3 || snap.error_message().find("connect") != std::string::npos;
      if (from_registry && !find_job(list_jobs(), name)) gone = true;
      if (gone) {
        std::printf("%stroupe top: job %s at %s is gone (%s)\n", tty ? "\n" : "",
                    name.empty() ? "" : name.c_str(), endpoint.c_str(),
                    snap.error_message().c_str());
        return 0;
      }
      body = "(no answer: " + snap.error_message() + ")\n";
    } else {
      failures = 0;
      if (name.empty()) name = snap->job;
      std::map<std::string, actor_rates> rates;
      if (previous) {
        double dt = snap->uptime_s - previous->uptime_s;  // the job's clock, when it moves
        if (!(dt > 0)) dt = std::chrono::duration<double>(started - previous_at).count();
        rates = compute_rates(*previous, *snap, dt);
      }
      winsize ws{};
      bool sized = tty && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 && ws.ws_col > 0;
      int width = a.width >= 0 ? a.width : sized ? ws.ws_col : 0;
      body = render_table(*snap, width, rates);
      if (sized) body = fit_height(body, ws.ws_row - 1);
      previous = std::move(*snap);
      previous_at = started;
    }
    std::string out = tty ? "\x1b[H\x1b[2J" : (frame ? "\n" : "");
    char every[32];
    std::snprintf(every, sizeof every, "%g", a.interval_s);
    out += "troupe top: " + endpoint + ", every " + every + " s" + (tty ? ", Ctrl-C to quit" : "") +
           "\n" + body;
    std::fputs(out.c_str(), stdout);
    std::fflush(stdout);
    if (a.iterations && frame + 1 == a.iterations) break;
    while (!stop_requested && clock::now() - started < interval)
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    if (stop_requested) break;
  }
  return 0;
}

}  // namespace

command_fn add_top_command(CLI::App& app) {
  auto a = std::make_shared<top_args>();
  auto* sub = app.add_subcommand("top", "Watch the members and actors of a running job live");
  sub->add_option("--job", a->job, "Job name (needed when several jobs run on this host)");
  sub->add_option("--endpoint", a->endpoint,
                  "HOST:PORT of the job's introspection endpoint (instead of the job registry)");
  sub->add_option("--interval", a->interval_s, "Seconds between refreshes")
      ->capture_default_str()
      ->check(CLI::Range(0.05, 3600.0));
  sub->add_option("--iterations", a->iterations, "Stop after this many frames (0: never)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--width", a->width,
                  "Cut lines to this many columns (0: no limit; default: the terminal's width)");
  sub->add_option("--timeout", a->timeout_s, "Seconds to wait for each answer")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  return [sub, a]() -> int {
    if (!sub->parsed()) return -1;
    return run_top(*a);
  };
}

}  // namespace troupe::apps
