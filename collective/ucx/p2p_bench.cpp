// p2p_bench (see p2p_bench.hpp): osu_bw / ucx_perftest-style loops on the transport interface.
#include "collective/ucx/p2p_bench.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <vector>

#include "memory/error.hpp"

namespace troupe::collective::p2p_bench {

namespace {

using clock = std::chrono::steady_clock;

constexpr std::uint64_t tag_base = std::uint64_t{1} << 46;
constexpr std::uint64_t tag_data = tag_base + 1;
constexpr std::uint64_t tag_ready = tag_base + 2;
constexpr std::uint64_t tag_ack = tag_base + 3;
constexpr std::uint64_t tag_result = tag_base + 4;
constexpr std::uint64_t tag_ping = tag_base + 5;
constexpr std::uint64_t tag_pong = tag_base + 6;

void check_args(transport& t, int peer, std::size_t bytes, int iterations, const char* what) {
  TROUPE_CHECK(peer >= 0 && peer < t.size() && peer != t.rank(), "p2p_bench::", what, " on rank ",
               t.rank(), ": invalid peer ", peer);
  TROUPE_CHECK(iterations > 0, "p2p_bench::", what, " on rank ", t.rank(), ": iterations ",
               iterations, " must be positive");
  TROUPE_CHECK(bytes > 0, "p2p_bench::", what, " on rank ", t.rank(), ": zero-byte messages");
}

void send_now(transport& t, int peer, std::uint64_t tag, const void* data, std::size_t n) {
  auto r = t.isend(peer, tag, data, n);
  t.wait(r);
}

void recv_now(transport& t, int peer, std::uint64_t tag, void* data, std::size_t n) {
  auto r = t.irecv(peer, tag, data, n);
  t.wait(r);
}

// The sender's result travels to the receiver so both ranks return the same number.
double share(transport& t, int peer, bool sender, double value) {
  if (sender) {
    send_now(t, peer, tag_result, &value, sizeof value);
  } else {
    recv_now(t, peer, tag_result, &value, sizeof value);
  }
  return value;
}

// One streaming run of `count` messages; returns the sender's seconds (0 on the receiver).
double stream(transport& t, int peer, bool sender, std::vector<std::uint8_t>& buf, int count,
              int window) {
  std::uint8_t token = 0;
  std::deque<p2p_request> inflight;
  if (sender) {
    recv_now(t, peer, tag_ready, &token, 1);  // the receiver has posted its first receives
    auto start = clock::now();
    for (int i = 0; i < count; ++i) {
      if (static_cast<int>(inflight.size()) == window) {
        t.wait(inflight.front());
        inflight.pop_front();
      }
      inflight.push_back(t.isend(peer, tag_data, buf.data(), buf.size()));
    }
    for (auto& r : inflight) t.wait(r);
    recv_now(t, peer, tag_ack, &token, 1);
    return std::chrono::duration<double>(clock::now() - start).count();
  }
  int posted = 0;
  for (; posted < std::min(window, count); ++posted) {
    inflight.push_back(t.irecv(peer, tag_data, buf.data(), buf.size()));
  }
  send_now(t, peer, tag_ready, &token, 1);
  while (!inflight.empty()) {
    t.wait(inflight.front());
    inflight.pop_front();
    if (posted < count) {
      inflight.push_back(t.irecv(peer, tag_data, buf.data(), buf.size()));
      ++posted;
    }
  }
  send_now(t, peer, tag_ack, &token, 1);
  return 0;
}

}  // namespace

double bandwidth(transport& t, int peer, std::size_t bytes, int iterations, int window) {
  check_args(t, peer, bytes, iterations, "bandwidth");
  TROUPE_CHECK(window > 0, "p2p_bench::bandwidth on rank ", t.rank(), ": window ", window,
               " must be positive");
  const bool sender = t.rank() < peer;
  std::vector<std::uint8_t> buf(bytes);
  std::memset(buf.data(), sender ? 0x5a : 0, bytes);  // touch every page before timing
  stream(t, peer, sender, buf, std::clamp(iterations / 10, 2, 20), window);  // warm-up
  double seconds = stream(t, peer, sender, buf, iterations, window);
  double gbps = sender ? static_cast<double>(bytes) * iterations / seconds / 1e9 : 0;
  return share(t, peer, sender, gbps);
}

double latency(transport& t, int peer, std::size_t bytes, int iterations) {
  check_args(t, peer, bytes, iterations, "latency");
  const bool first = t.rank() < peer;
  std::vector<std::uint8_t> out(bytes, 0x5a), in(bytes);
  // Blocking send, then blocking receive, as ucx_perftest's tag_lat does.
  auto strict_rounds = [&](int count) {
    for (int i = 0; i < count; ++i) {
      if (first) {
        send_now(t, peer, tag_ping, out.data(), bytes);
        recv_now(t, peer, tag_pong, in.data(), bytes);
      } else {
        recv_now(t, peer, tag_ping, in.data(), bytes);
        send_now(t, peer, tag_pong, out.data(), bytes);
      }
    }
  };
  strict_rounds(std::clamp(iterations / 10, 10, 1000));  // warm-up
  auto start = clock::now();
  strict_rounds(iterations);
  double us = std::chrono::duration<double, std::micro>(clock::now() - start).count();
  return share(t, peer, first, us / (2.0 * iterations));
}

}  // namespace troupe::collective::p2p_bench
