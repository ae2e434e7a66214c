// A bare CAF echo pair for troupe bench p2p: the same actor systems, no troupe message types.
#include "actors/caf_baseline.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <chrono>

#include "actors/node_impl.hpp"
#include "memory/error.hpp"

namespace troupe::actors {
namespace {

using ping_atom = caf::atom_constant<caf::atom("ping")>;

// (The unused argument keeps CAF 0.17 from binding a reference to an empty, null argument tuple,
// which UBSan reports.)
caf::behavior echo_actor(caf::event_based_actor*, int) {
  return {[](ping_atom, std::uint64_t x) { return x; }};
}

}  // namespace

std::uint16_t start_raw_echo(node& n) {
  auto& I = n.internals();
  TROUPE_CHECK(I.sys, "start_raw_echo: the node is shut down");
  // A plain listener beside TLS would carry control traffic in the clear (and CAF 0.17 breaks a
  // second connection between two TLS-connected processes): not offered with TLS.
  TROUPE_CHECK(!detail::uses_tls(*I.sys),
               "start_raw_echo: the raw CAF baseline is not available in a job with TLS");
  auto echo = I.sys->spawn(echo_actor, 0);
  const bool wildcard = I.info.bind.empty() || I.info.bind == "0.0.0.0";
  auto port = I.sys->middleman().publish(echo, 0, wildcard ? nullptr : I.info.bind.c_str(), true);
  if (!port) {
    caf::anon_send_exit(echo, caf::exit_reason::user_shutdown);
    TROUPE_FAIL("rank ", I.rank, ": cannot publish the echo actor: ", I.sys->render(port.error()));
  }
  // Stops with the node: its shutdown ends every actor of the system.
  {
    std::lock_guard<std::mutex> lock(I.mu);
    I.extra_actors.push_back(echo);
  }
  return *port;
}

std::vector<double> raw_caf_rtt_us(node& n, const std::string& host, std::uint16_t port,
                                   int iterations, int warmup) {
  auto& I = n.internals();
  TROUPE_CHECK(I.sys, "raw_caf_rtt_us: the node is shut down");
  auto echo = I.sys->middleman().remote_actor(host, port);
  if (!echo)
    TROUPE_FAIL("rank ", I.rank, ": cannot reach the echo actor at ", host, ":", port, ": ",
                I.sys->render(echo.error()));
  caf::scoped_actor self{*I.sys};
  std::vector<double> out;
  out.reserve(static_cast<std::size_t>(iterations));
  std::string failure;
  for (int i = 0; i < warmup + iterations && failure.empty(); ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    self->request(*echo, std::chrono::seconds(10), ping_atom::value, std::uint64_t(i))
        .receive([](std::uint64_t) {}, [&](caf::error& e) { failure = I.sys->render(e); });
    const auto t1 = std::chrono::steady_clock::now();
    if (i >= warmup) out.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  if (!failure.empty()) TROUPE_FAIL("rank ", I.rank, ": raw CAF request failed: ", failure);
  return out;
}

}  // namespace troupe::actors
