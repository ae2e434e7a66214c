// The rank program of the multi-process tests (run under `troupe launch` or started directly):
//   exchange            every rank sends tensors of 1 KiB .. 64 MiB to the next rank by handle and
//                       checks what it gets from the previous one byte for byte
//   loss --victim V     rank V waits to be killed or stopped; the others keep receives from it
//                       pending and report how they fail, and the membership callback
//   hold                join, then a barrier (the partner of the wrong-token test)
// Every line is flushed at once so that the test sees it as it happens.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "actors/node.hpp"

namespace {

using namespace troupe::actors;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

// The bytes rank `src` sends in its tensor of `size` bytes: a per-word hash, so a shifted,
// truncated or swapped buffer never matches.
void fill(std::vector<std::uint8_t>& buf, int src, std::size_t size) {
  buf.resize(size);
  std::uint32_t x = 0x9e3779b9u ^ static_cast<std::uint32_t>(src * 7919 + size);
  for (std::size_t i = 0; i < size; i += 4) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    const std::size_t n = std::min<std::size_t>(4, size - i);
    std::memcpy(buf.data() + i, &x, n);
  }
}

int exchange(node& n) {
  const int world = n.world_size(), me = n.rank();
  const int next = (me + 1) % world, prev = (me + world - 1) % world;
  const std::vector<std::size_t> sizes = {1 << 10, 4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20};
  std::vector<std::uint8_t> out, in, expect;
  std::size_t total = 0;
  for (std::size_t k = 0; k < sizes.size(); ++k) {
    const std::size_t size = sizes[k];
    fill(out, me, size);
    const std::int64_t shape[2] = {static_cast<std::int64_t>(size / 4), 4};
    auto send =
        n.send_tensor(next, out.data(), troupe::dtype::u8, shape, "ring/" + std::to_string(size));
    in.assign(size, 0);
    tensor_info info;
    if (k % 2 == 0) {
      info = n.next_tensor(60s, prev);  // announcement first, then the bytes
      n.receive(info, in.data(), in.size(), 60s);
    } else {
      info = n.receive_next(prev, in.data(), in.size(), 60s);  // pre-posted
    }
    send.wait(60s);
    fill(expect, prev, size);
    if (info.source != prev || info.bytes != size || info.shape.size() != 2 ||
        info.shape[0] != static_cast<std::int64_t>(size / 4) ||
        info.name != "ring/" + std::to_string(size) || info.type != troupe::dtype::u8) {
      std::printf(
          "exchange FAILED: rank %d: wrong announcement for %zu bytes from rank %d: "
          "source %d, bytes %zu, name %s\n",
          me, size, prev, info.source, info.bytes, info.name.c_str());
      return 1;
    }
    if (std::memcmp(in.data(), expect.data(), size) != 0) {
      std::size_t bad = 0;
      while (bad < size && in[bad] == expect[bad]) ++bad;
      std::printf(
          "exchange FAILED: rank %d: tensor of %zu bytes from rank %d differs at byte %zu\n", me,
          size, prev, bad);
      return 1;
    }
    total += size;
  }
  n.barrier("exchange", 60s);
  std::printf("exchange ok: rank %d received %zu tensors (%zu bytes) from rank %d byte-exact\n", me,
              sizes.size(), total, prev);
  return 0;
}

int loss(node& n, int victim) {
  const int me = n.rank();
  if (me == victim) {
    std::printf("ready rank %d pid %d (victim)\n", me, static_cast<int>(::getpid()));
    std::this_thread::sleep_for(120s);  // killed or stopped by the test long before
    return 3;
  }
  std::mutex mu;
  std::string callback;
  std::atomic<bool> called{false};
  n.on_membership([&](const member_event& e) {
    if (e.kind != member_event::lost || e.rank != victim) return;
    std::lock_guard<std::mutex> lock(mu);
    callback = "rank " + std::to_string(e.rank) + " lost: " + e.reason + " (epoch " +
               std::to_string(e.epoch) + ")";
    called = true;
  });
  // Two receives from the victim that can never complete: one by handle, one on the raw transport
  // (the collectives' half of the tag space).
  std::vector<std::uint8_t> a(1 << 20), b(1 << 20);
  auto by_handle = n.post_receive_next(victim, a.data(), a.size());
  auto raw = n.transport().irecv(victim, 7, b.data(), b.size());
  std::printf("ready rank %d pid %d\n", me, static_cast<int>(::getpid()));
  int bad = 0;
  try {
    by_handle.wait(60s);
    std::printf("UNEXPECTED: rank %d received from the victim\n", me);
    bad = 1;
  } catch (const std::exception& e) {
    std::printf("pending receive failed: rank %d: %s\n", me, e.what());
  }
  try {
    n.transport().wait(raw, 5000ms);
    std::printf("UNEXPECTED: rank %d: raw receive completed\n", me);
    bad = 1;
  } catch (const std::exception& e) {
    std::printf("pending transport receive failed: rank %d: %s\n", me, e.what());
  }
  try {
    n.next_tensor(5000ms, victim);
    std::printf("UNEXPECTED: rank %d: next_tensor returned\n", me);
    bad = 1;
  } catch (const std::exception& e) {
    std::printf("next_tensor failed: rank %d: %s\n", me, e.what());
  }
  for (int i = 0; i < 500 && !called; ++i) std::this_thread::sleep_for(10ms);
  {
    std::lock_guard<std::mutex> lock(mu);
    if (!called) {
      std::printf("UNEXPECTED: rank %d: no membership callback\n", me);
      bad = 1;
    } else {
      std::printf("membership callback: rank %d: %s\n", me, callback.c_str());
    }
  }
  for (int r : n.alive())
    if (r == victim) {
      std::printf("UNEXPECTED: rank %d still lists rank %d as alive\n", me, victim);
      bad = 1;
    }
  // The survivors still work together.
  n.barrier("survivors", 30s);
  std::printf("survivors barrier passed: rank %d\n", me);
  return bad;
}

int hold(node& n) {
  std::printf("ready rank %d pid %d\n", n.rank(), static_cast<int>(::getpid()));
  n.barrier("hold", 60s);
  std::printf("hold done: rank %d\n", n.rank());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::setvbuf(stderr, nullptr, _IOLBF, 0);
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s exchange | loss --victim V | hold\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  int victim = 1;
  for (int i = 2; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--victim") == 0) victim = std::atoi(argv[i + 1]);
  try {
    node n;
    int rc = 2;
    if (mode == "exchange")
      rc = exchange(n);
    else if (mode == "loss")
      rc = loss(n, victim);
    else if (mode == "hold")
      rc = hold(n);
    else
      std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    n.shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_multirank_worker: error: %s\n", e.what());
    return 1;
  }
}
