// The baseline troupe's actor requests are measured against: a bare CAF actor pair (one echo
// actor, one scoped requester) on the same actor systems, in the same run (troupe bench p2p).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "actors/node.hpp"

namespace troupe::actors {

// Publishes a bare CAF echo actor on this node's actor system (at its bind address); returns the
// port. It lives until the node shuts down.
std::uint16_t start_raw_echo(node& n);

// Round trips of `iterations` plain CAF requests (request(...).receive(...)) to the echo actor at
// host:port, after `warmup` untimed ones: microseconds per round trip.
std::vector<double> raw_caf_rtt_us(node& n, const std::string& host, std::uint16_t port,
                                   int iterations, int warmup);

}  // namespace troupe::actors
