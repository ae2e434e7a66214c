// Point-to-point bandwidth and latency between two ranks of any transport (troupe bench p2p).
//
// Both ranks call the same function with each other as `peer`; the lower rank sends (bandwidth)
// or starts the ping-pong (latency), and both return the sender's measurement. Like ucx_perftest,
// each side uses one buffer for all its messages, so the numbers are comparable with its tag_bw
// and tag_lat: GB/s are 1e9 bytes per second (ucx_perftest prints MB/s of 2^20 bytes), latency is
// half a round trip in microseconds. The tags used have bit 46 set: run the benchmark on a
// transport nothing else is using.
#pragma once

#include <cstddef>

#include "collective/transport.hpp"

namespace troupe::collective::p2p_bench {

// Streams `iterations` messages of `bytes` with at most `window` outstanding at a time (after a
// few untimed warm-up messages) and returns GB/s, timed by the sender from the first send to the
// receiver's acknowledgement of the last message.
double bandwidth(transport& t, int peer, std::size_t bytes, int iterations, int window);

// Ping-pong of `bytes`-byte messages, `iterations` round trips after a warm-up; returns the
// one-way latency (round trip / 2) in microseconds.
double latency(transport& t, int peer, std::size_t bytes, int iterations);

}  // namespace troupe::collective::p2p_bench
