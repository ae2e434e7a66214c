// troupe ps: the members and actors of a running job, read from its introspection endpoint;
// --collectives adds the flight records of every watched communicator.
#include <sys/ioctl.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdio>
#include <memory>

#include "actors/introspection/http_client.hpp"
#include "actors/introspection/job_registry.hpp"
#include "actors/introspection/render.hpp"
#include "apps/commands.hpp"

namespace troupe::apps {
namespace {
using namespace troupe::actors;

struct ps_args {
  std::string job, endpoint;
  bool json = false;
  bool collectives = false;
  int width = -1;  // -1: the terminal's, or no limit when not a terminal
  double timeout_s = 5;
};

int run_ps(const ps_args& a) {
  std::string endpoint = a.endpoint;
  if (endpoint.empty()) {
    auto job = find_job(list_jobs(), a.job);
    if (!job) {
      std::fprintf(stderr, "troupe ps: %s\n", job.error_message().c_str());
      return 1;
    }
    endpoint = job->endpoint;
  }
  auto ep = parse_endpoint(endpoint);
  if (!ep) {
    std::fprintf(stderr, "troupe ps: %s\n", ep.error_message().c_str());
    return 1;
  }
  auto timeout = std::chrono::milliseconds(static_cast<long long>(a.timeout_s * 1000));
  auto r = http_get(ep->first, ep->second, "/json", timeout);
  if (!r) {
    std::fprintf(stderr, "troupe ps: %s\n", r.error_message().c_str());
    return 1;
  }
  if (a.json) {
    std::fputs(r->c_str(), stdout);
    return 0;
  }
  auto snap = snapshot_from_json(*r, "http://" + endpoint + "/json");
  if (!snap) {
    std::fprintf(stderr, "troupe ps: %s\n", snap.error_message().c_str());
    return 1;
  }
  int width = a.width;
  winsize ws{};
  if (width < 0)
    width = isatty(STDOUT_FILENO) && ioctl(STDOUT_FILENO, TIOCGWINSZ, &ws) == 0 ? ws.ws_col : 0;
  std::fputs(render_table(*snap, width).c_str(), stdout);
  if (a.collectives) {
    std::fputs("\n", stdout);
    std::fputs(render_collectives(*snap, width).c_str(), stdout);
  }
  return 0;
}

}  // namespace

command_fn add_ps_command(CLI::App& app) {
  auto a = std::make_shared<ps_args>();
  auto* sub = app.add_subcommand("ps", "Show the members and actors of a running job");
  sub->add_option("--job", a->job, "Job name (needed when several jobs run on this host)");
  sub->add_option("--endpoint", a->endpoint,
                  "HOST:PORT of the job's introspection endpoint (instead of the job registry)");
  sub->add_flag("--json", a->json, "Print the snapshot as JSON");
  sub->add_flag("--collectives", a->collectives,
                "Also list every recent collective of every actor (its flight recorder)");
  sub->add_option("--width", a->width,
                  "Cut lines to this many columns (0: no limit; default: the "
                  "terminal's width)");
  sub->add_option("--timeout", a->timeout_s, "Seconds to wait for the endpoint")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  return [sub, a]() -> int {
    if (!sub->parsed()) return -1;
    return run_ps(*a);
  };
}

}  // namespace troupe::apps
