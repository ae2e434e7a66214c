// An actor script: every rank registers a "worker" role; the driver (rank 0) spawns one worker per
// rank, fans a request out and gathers the replies, then has two workers pass a tensor by handle
// (the announcement goes over CAF, the bytes over UCX) and checks it arrived intact.
//
//   build/apps/troupe launch -n 4 -- build/apps/examples/troupe_example_roles
//   ... --hold 30     keeps the job up for 30 s afterwards (try `troupe ps` meanwhile); a SIGUSR1
//                     to rank 0 ends the hold early
#include <fmt/core.h>
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <numeric>
#include <string>
#include <thread>
#include <vector>

#include "actors/node.hpp"
#include "actors/roles.hpp"

namespace {

using namespace troupe::actors;
using namespace std::chrono_literals;

// Requests and replies: plain structs; fields() tells the codec what to send.
struct stats_request {
  std::vector<float> values;
  std::string label;
  auto fields() { return std::tie(values, label); }
};
struct stats_reply {
  std::string worker;
  int rank = -1;
  double weighted_sum = 0;  // sum(values) * (rank + 1)
  auto fields() { return std::tie(worker, rank, weighted_sum); }
};
struct pass_tensor {  // "send `elements` floats to `to`"
  role_handle to;
  std::int64_t elements = 0;
  auto fields() { return std::tie(to, elements); }
};
struct received_request {
  std::uint8_t unused = 0;
};
struct received_reply {
  std::string from;
  std::int64_t elements = 0;
  double checksum = 0;
  auto fields() { return std::tie(from, elements, checksum); }
};

float value_at(std::int64_t i, int rank) {
  return static_cast<float>(i % 1000) * 0.5f + rank;
}

double checksum(const float* p, std::int64_t n) {
  double s = 0;
  for (std::int64_t i = 0; i < n; ++i)
    s += static_cast<double>(p[i]) * static_cast<double>(i % 7 + 1);
  return s;
}

// The worker role: its state lives in the factory's closure, one per actor.
void make_worker(role_builder& b, role_context& ctx) {
  struct state {
    std::mutex mu;
    received_reply last;
  };
  auto st = std::make_shared<state>();
  b.on<stats_request>([](role_context& c, const stats_request& r) {
    c.set_activity("summing \"" + r.label + "\"");
    const double sum = std::accumulate(r.values.begin(), r.values.end(), 0.0);
    c.set_metric("requests", 1);
    c.set_activity("idle");
    return stats_reply{c.name(), c.rank(), sum * (c.rank() + 1)};
  });
  b.on<pass_tensor>([](role_context& c, const pass_tensor& p) {
    std::vector<float> data(static_cast<std::size_t>(p.elements));
    for (std::int64_t i = 0; i < p.elements; ++i) data[i] = value_at(i, c.rank());
    const std::int64_t shape[1] = {p.elements};
    c.set_activity("sending a tensor to " + p.to.name);
    c.send_tensor(p.to, data.data(), troupe::dtype::f32, shape, "payload").wait(10s);
    c.set_activity("idle");
    return checksum(data.data(), p.elements);
  });
  b.on_tensor([st](role_context& c, const tensor_info& t) {
    c.set_activity("receiving \"" + t.name + "\" from rank " + std::to_string(t.source));
    auto r = c.receive(t, 10s);
    const std::int64_t n = t.shape.empty() ? 0 : t.shape[0];
    std::lock_guard<std::mutex> lock(st->mu);
    st->last = received_reply{"rank " + std::to_string(t.source), n,
                              checksum(static_cast<const float*>(r.data.data()), n)};
    c.set_activity("idle");
  });
  b.on<received_request>([st](role_context&, const received_request&) {
    std::lock_guard<std::mutex> lock(st->mu);
    return st->last;
  });
  ctx.set_mesh("rank", ctx.rank());
}

int drive(node& n, double hold_s) {
  job j(n);
  auto workers = j.spawn_on_all("worker");
  std::string names;
  for (const auto& w : workers) names += (names.empty() ? "" : ", ") + w.name;
  fmt::print("spawned {} workers: {}\n", workers.size(), names);

  // Fan out one request, gather every reply (in handle order).
  auto replies = j.ask_all<stats_reply>(workers, stats_request{{1, 2, 3, 4}, "fan-out"}, 10s);
  for (const auto& r : replies)
    fmt::print("  {} on rank {}: weighted sum {}\n", r.worker, r.rank, r.weighted_sum);

  // A tensor from the last worker to the first, by handle.
  if (workers.size() >= 2) {
    const auto& from = workers.back();
    const auto& to = workers.front();
    const std::int64_t elements = 1 << 20;
    const double sent = j.ask<double>(from, pass_tensor{to, elements}, 20s);
    // The receiver checksums the bytes after they arrived: ask until it did (20 s at most).
    received_reply got;
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (got.elements == 0 && std::chrono::steady_clock::now() < deadline) {
      got = j.ask<received_reply>(to, received_request{}, 10s);
      if (got.elements == 0) std::this_thread::sleep_for(10ms);
    }
    const bool ok = got.elements == elements && got.checksum == sent;
    fmt::print("tensor of {} f32 from {} to {}: checksum sent {}, received {} ({})\n", elements,
               from.name, to.name, sent, got.checksum, ok ? "match" : "MISMATCH");
    if (!ok) return 1;
  }
  if (hold_s > 0) {
    fmt::print("holding the job for {} s (troupe ps / troupe top; SIGUSR1 ends it)\n", hold_s);
    std::fflush(stdout);
    // main() blocked SIGUSR1 in every thread: it waits here until it comes or the time is up.
    sigset_t usr1;
    sigemptyset(&usr1);
    sigaddset(&usr1, SIGUSR1);
    const auto until = std::chrono::steady_clock::now() + std::chrono::duration<double>(hold_s);
    for (auto left = until - std::chrono::steady_clock::now(); left > 0s;
         left = until - std::chrono::steady_clock::now()) {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
      const timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      if (sigtimedwait(&usr1, nullptr, &ts) == SIGUSR1) {
        fmt::print("hold ended by SIGUSR1\n");
        break;
      }
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  double hold_s = 0;
  for (int i = 1; i < argc; ++i)
    if (std::strcmp(argv[i], "--hold") == 0 && i + 1 < argc) hold_s = std::atof(argv[++i]);
  // SIGUSR1 ends a hold (drive): blocked before any thread starts, so only sigtimedwait takes it.
  sigset_t usr1;
  sigemptyset(&usr1);
  sigaddset(&usr1, SIGUSR1);
  pthread_sigmask(SIG_BLOCK, &usr1, nullptr);
  try {
    role_registry roles;
    roles.add("worker", make_worker);
    node_options options;
    options.roles = &roles;
    node n(options);
    if (n.rank() == 0)
      fmt::print("job {}: {} ranks, coordinator {}\n", n.job(), n.world_size(), n.coordinator());
    int rc = 0;
    if (n.rank() == 0) rc = drive(n, hold_s);
    // The other ranks serve their workers until the driver is done (bounded: a driver that never
    // comes fails the barrier instead of holding every rank forever).
    n.barrier("done", std::chrono::seconds(120 + static_cast<int>(hold_s)));
    n.shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_example_roles: error: %s\n", e.what());
    return 1;
  }
}
