// `troupe bench p2p`: the actor runtime between two processes on this host, next to its baselines
// measured in the same run:
//   - request round trip: job.ask to a role actor on the other rank (p50/p99), next to a bare CAF
//     request to a plain echo actor on the same actor systems;
//   - tensor by handle: send_tensor + receive_next (announcement over CAF, bytes over UCX) at
//     4 MiB and 64 MiB, next to the raw transport (collective/ucx/p2p_bench.hpp) in the same pair
//     of processes. GB/s are 1e9 bytes per second.
// The command launches itself twice through the launcher (ranks pinned to their own CPUs) with
// --worker; rank 0 writes a JSON report that the parent prints.
#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "actors/bootstrap.hpp"
#include "actors/caf_baseline.hpp"
#include "actors/launcher.hpp"
#include "actors/node.hpp"
#include "actors/roles.hpp"
#include "apps/commands.hpp"
#include "collective/ucx/p2p_bench.hpp"
#include "collective/ucx/ucx_transport.hpp"

namespace troupe::apps {
namespace {

using clock_type = std::chrono::steady_clock;
using ms = std::chrono::milliseconds;

struct p2p_args {
  int rtt_iterations = 2000;  // per round, for each of the two request kinds
  int rounds = 5;             // alternating rounds of troupe asks and bare CAF requests
  int reps = 5;               // bandwidth repetitions per size (the median is reported)
  int window = 4;             // the second by-handle window
  bool no_pin = false;
  bool json = false;
  bool worker = false;
  std::string report;
};

// A request as small as a control message gets.
struct ping {
  std::uint64_t seq = 0;
  auto fields() { return std::tie(seq); }
};
struct echo_port_request {
  std::uint8_t unused = 0;
};

struct stats {
  double p50 = 0, p99 = 0, mean = 0;
};
stats summarize(std::vector<double> v) {
  stats s;
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.p50 = v[v.size() / 2];
  s.p99 = v[std::min(v.size() - 1, v.size() * 99 / 100)];
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return s;
}
double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::uint8_t pattern(std::size_t i, std::size_t size) {
  return static_cast<std::uint8_t>((i * 131 + size / 7 + 17) & 0xff);
}

// Rank 0 streams `iterations` tensors to rank 1 with at most `window` sends outstanding (and rank
// 1 keeps `window` receives posted), then waits for rank 1's 8-byte acknowledgement; returns GB/s
// on rank 0 (0 on rank 1).
double by_handle(actors::node& n, std::vector<std::uint8_t>& buf, int iterations, int window,
                 bool data_only) {
  const std::size_t size = buf.size();
  const std::int64_t shape[1] = {static_cast<std::int64_t>(size)};
  const std::int64_t ack_shape[1] = {8};
  std::uint64_t ack = 0;
  if (n.rank() == 0) {
    const auto t0 = clock_type::now();
    std::vector<actors::tensor_send> inflight;
    for (int i = 0; i < iterations; ++i) {
      if (static_cast<int>(inflight.size()) == window) {
        inflight.front().wait();
        inflight.erase(inflight.begin());
      }
      inflight.push_back(n.send_tensor(1, buf.data(), dtype::u8, shape, "bench"));
    }
    for (auto& s : inflight) s.wait();
    n.receive_next(1, &ack, sizeof ack);
    const double s = std::chrono::duration<double>(clock_type::now() - t0).count();
    return static_cast<double>(size) * iterations / s / 1e9;
  }
  // Receives are pre-posted `window` deep (into the one buffer, as ucx_perftest does).
  std::vector<actors::tensor_recv> posted;
  int next = 0;
  for (int i = 0; i < iterations; ++i) {
    while (next < iterations && next < i + window) {
      posted.push_back(n.post_receive_next(0, buf.data(), size));
      ++next;
    }
    if (data_only)
      posted.front().wait_data();
    else
      posted.front().wait();
    posted.erase(posted.begin());
  }
  n.send_tensor(0, &ack, dtype::u8, ack_shape, "ack").wait();
  return 0;
}

int run_worker(const p2p_args& a) {
  actors::role_registry roles;
  roles.add("bench", [](actors::role_builder& b, actors::role_context&) {
    b.on<ping>([](actors::role_context&, const ping& p) { return p; });
    b.on<echo_port_request>([](actors::role_context& ctx, const echo_port_request&) {
      return actors::start_raw_echo(ctx.node());
    });
  });
  actors::node_options options;
  options.roles = &roles;
  actors::node n(options);
  if (n.world_size() != 2) {
    std::fprintf(stderr, "troupe bench p2p: needs exactly 2 ranks, got %d\n", n.world_size());
    return 1;
  }
  const int peer = 1 - n.rank();
  nlohmann::json report;
  n.barrier("start");

  // Request round trips, alternating blocks so that noise hits both kinds alike.
  if (n.rank() == 0) {
    actors::job j(n);
    auto h = j.spawn("bench", 1);
    const auto port = j.ask<std::uint16_t>(h, echo_port_request{});
    const std::string host = "127.0.0.1";  // both ranks run on this host
    std::vector<double> troupe_us, caf_us;
    for (int i = 0; i < 200; ++i) j.ask<ping>(h, ping{std::uint64_t(i)});
    for (int round = 0; round < a.rounds; ++round) {
      for (int i = 0; i < a.rtt_iterations; ++i) {
        const auto t0 = clock_type::now();
        auto r = j.ask<ping>(h, ping{std::uint64_t(i)});
        const auto t1 = clock_type::now();
        if (r.seq != std::uint64_t(i)) throw std::runtime_error("bench: wrong echo");
        troupe_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      }
      auto raw = actors::raw_caf_rtt_us(n, host, port, a.rtt_iterations, round == 0 ? 200 : 0);
      caf_us.insert(caf_us.end(), raw.begin(), raw.end());
    }
    const auto t = summarize(troupe_us), c = summarize(caf_us);
    report["rtt"] = {{"troupe_ask", {{"p50_us", t.p50}, {"p99_us", t.p99}, {"mean_us", t.mean}}},
                     {"bare_caf", {{"p50_us", c.p50}, {"p99_us", c.p99}, {"mean_us", c.mean}}},
                     {"samples", troupe_us.size()}};
  }
  n.barrier("bandwidth");

  // Bandwidth: raw transport and by handle, alternating per repetition.
  report["bandwidth"] = nlohmann::json::array();
  for (std::size_t size : {std::size_t(4) << 20, std::size_t(64) << 20}) {
    const int iterations = size > (std::size_t(8) << 20) ? 16 : 128;
    std::vector<std::uint8_t> buf(size);
    if (n.rank() == 0)
      for (std::size_t i = 0; i < size; ++i) buf[i] = pattern(i, size);
    std::vector<double> raw, w1, ww;
    std::vector<double> w1d;
    by_handle(n, buf, 2, 1, false);  // warm-up: endpoints, registration caches
    for (int rep = 0; rep < a.reps; ++rep) {
      raw.push_back(collective::p2p_bench::bandwidth(n.transport(), peer, size, iterations, 1));
      w1.push_back(by_handle(n, buf, iterations, 1, false));
      w1d.push_back(by_handle(n, buf, iterations, 1, true));
      ww.push_back(by_handle(n, buf, iterations, a.window, false));
    }
    if (n.rank() == 1) {
      // The last tensor must have arrived byte-exact.
      for (std::size_t i = 0; i < size; ++i)
        if (buf[i] != pattern(i, size)) {
          std::fprintf(stderr, "bench: byte %zu of the %zu-byte tensor differs\n", i, size);
          return 1;
        }
    }
    report["bandwidth"].push_back({{"bytes", size},
                                   {"iterations", iterations},
                                   {"raw_transport_gbps", median(raw)},
                                   {"by_handle_w1_gbps", median(w1)},
                                   {"by_handle_w1_data_only_gbps", median(w1d)},
                                   {"by_handle_window", a.window},
                                   {"by_handle_wn_gbps", median(ww)}});
    n.barrier("size");
  }
  if (auto* u = dynamic_cast<collective::ucx_transport*>(&n.transport()))
    report["transports"] = u->transports();
  n.barrier("end");
  if (n.rank() == 0 && !a.report.empty()) {
    std::ofstream f(a.report);
    f << report.dump(2) << "\n";
    if (!f) {
      std::fprintf(stderr, "bench: cannot write %s\n", a.report.c_str());
      return 1;
    }
  }
  return 0;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  if (n <= 0) return "troupe";
  return std::string(buf, static_cast<std::size_t>(n));
}

int run_parent(const p2p_args& a) {
  char path[] = "/tmp/troupe-bench-p2p-XXXXXX";
  const int fd = ::mkstemp(path);
  if (fd < 0) {
    std::perror("troupe bench p2p: mkstemp");
    return 1;
  }
  ::close(fd);
  actors::launch_options lo;
  lo.nprocs = 2;
  lo.pin = !a.no_pin;
  lo.quiet = true;
  lo.job = "bench-p2p-" + actors::generate_token().substr(0, 6);
  lo.command = {self_exe(),     "bench",
                "p2p",          "--worker",
                "--report",     path,
                "--iterations", std::to_string(a.rtt_iterations),
                "--rounds",     std::to_string(a.rounds),
                "--reps",       std::to_string(a.reps),
                "--window",     std::to_string(a.window)};
  const int rc = actors::launch(lo);
  std::ifstream f(path);
  nlohmann::json r;
  if (rc == 0 && f) {
    try {
      f >> r;
    } catch (const std::exception& e) {
      std::fprintf(stderr, "troupe bench p2p: bad report %s: %s\n", path, e.what());
      ::unlink(path);
      return 1;
    }
  }
  ::unlink(path);
  if (rc != 0 || r.is_null()) {
    std::fprintf(stderr, "troupe bench p2p: the benchmark ranks failed\n");
    return 1;
  }
  if (a.json) {
    fmt::print("{}\n", r.dump(2));
    return 0;
  }
  const auto& t = r["rtt"]["troupe_ask"];
  const auto& c = r["rtt"]["bare_caf"];
  fmt::print("troupe bench p2p: 2 ranks on this host{}; UCX transports: {}\n",
             !a.no_pin ? ", pinned to their own CPUs" : "", r.value("transports", "?"));
  fmt::print("\nrequest round trip ({} samples each)      p50 us    p99 us   mean us\n",
             r["rtt"]["samples"].get<std::size_t>());
  fmt::print("  troupe job.ask to a role actor      {:9.1f} {:9.1f} {:9.1f}\n",
             t["p50_us"].get<double>(), t["p99_us"].get<double>(), t["mean_us"].get<double>());
  fmt::print("  bare CAF request to an echo actor   {:9.1f} {:9.1f} {:9.1f}\n",
             c["p50_us"].get<double>(), c["p99_us"].get<double>(), c["mean_us"].get<double>());
  fmt::print("  troupe / CAF                        {:9.2f} {:9.2f} {:9.2f}\n",
             t["p50_us"].get<double>() / c["p50_us"].get<double>(),
             t["p99_us"].get<double>() / c["p99_us"].get<double>(),
             t["mean_us"].get<double>() / c["mean_us"].get<double>());
  fmt::print("\ntensor by handle (GB/s = 1e9 B/s, median of {}; ratios to the raw transport)\n",
             a.reps);
  fmt::print("  w1: one send in flight, the receiver waits for bytes and announcement\n");
  fmt::print("  w1 pre-posted: the same, the receiver takes the bytes without waiting for it\n");
  fmt::print("  w{}: {} sends in flight and {} receives posted\n", a.window, a.window, a.window);
  fmt::print("  size     raw      w1        w1 pre-posted   w{}\n", a.window);
  for (const auto& b : r["bandwidth"]) {
    const double raw = b["raw_transport_gbps"].get<double>();
    const double w1 = b["by_handle_w1_gbps"].get<double>();
    const double w1d = b["by_handle_w1_data_only_gbps"].get<double>();
    const double wn = b["by_handle_wn_gbps"].get<double>();
    fmt::print("  {:3d} MiB {:6.2f}  {:6.2f} {:4.2f}  {:6.2f} {:4.2f}     {:6.2f} {:4.2f}\n",
               b["bytes"].get<std::size_t>() >> 20, raw, w1, w1 / raw, w1d, w1d / raw, wn,
               wn / raw);
  }
  return 0;
}

}  // namespace

command_fn add_bench_p2p_command(CLI::App& bench) {
  auto a = std::make_shared<p2p_args>();
  auto* sub = bench.add_subcommand(
      "p2p",
      "Actor request round trip and tensor-by-handle bandwidth between 2 local ranks, next to "
      "bare CAF and the raw UCX transport");
  sub->add_option("--iterations", a->rtt_iterations, "Round trips per round and kind")
      ->check(CLI::PositiveNumber);
  sub->add_option("--rounds", a->rounds, "Alternating rounds of troupe and bare CAF requests")
      ->check(CLI::PositiveNumber);
  sub->add_option("--reps", a->reps, "Bandwidth repetitions per size")->check(CLI::PositiveNumber);
  sub->add_option("--window", a->window, "Sends outstanding in the second by-handle run")
      ->check(CLI::PositiveNumber);
  sub->add_flag("--no-pin", a->no_pin, "Do not pin the two ranks to their own CPUs");
  sub->add_flag("--json", a->json, "Print the raw JSON report");
  sub->add_flag("--worker", a->worker, "(internal) run as one of the two ranks")->group("");
  sub->add_option("--report", a->report, "(internal) where rank 0 writes its report")->group("");
  return [sub, a]() -> int {
    if (!sub->parsed()) return -1;
    return a->worker ? run_worker(*a) : run_parent(*a);
  };
}

}  // namespace troupe::apps
