// The rank program of the multi-process tests (run under `troupe launch` or started directly):
//   exchange            every rank sends tensors of 1 KiB .. 64 MiB to the next rank by handle and
//                       checks what it gets from the previous one byte for byte
//   loss --victim V     rank V waits to be killed or stopped; the others keep receives from it
//                       pending and report how they fail, and the membership callback
//   hold                join, then a barrier (the partner of the wrong-token test)
//   guarded --address-file F
//                       rank 0 writes its UCX address (hex) to F and waits until its transport
//                       refused a handshake, prints the refusals; then every rank runs exchange
//   rogue-ucx --address-file F --claim R --world N
//                       not a rank: knows rank 0's UCX address (from F) but not the token, claims
//                       rank R on the data plane and tries to send it a tensor
//   forge-announce      (3 ranks) rank 2 sends rank 0 a tensor announcement claiming to come from
//                       rank 1 (a member posing as another rank, through the node's own actor:
//                       the real control plane); rank 0 must refuse it and count it, then every
//                       rank runs exchange
//   early-exit          rank 1 exits before joining, the others try to join
//   rejoin              rank 2 is killed; a replacement (TROUPE_REPLACEMENT=1) takes its place and
//                       exchanges tensors with the survivors
//   roles               rank 0 drives "calc" role actors on every rank through the job API:
//   fan-out,
//                       typed errors, timeouts, a tensor sent to a role, a role on a killed rank
// Every line is flushed at once so that the test sees it as it happens.
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>

#include <fstream>

#include "actors/messages.hpp"
#include "actors/node.hpp"
#include "actors/node_impl.hpp"
#include "actors/roles.hpp"
#include "collective/ucx/ucx_transport.hpp"

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

// Membership events as a callback sees them; a rank waits for one on a condition variable.
struct member_events {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<member_event> got;
  void add(const member_event& e) {
    std::lock_guard<std::mutex> lock(mu);
    got.push_back(e);
    cv.notify_all();
  }
  // The first event of `kind` about `rank`; nullopt after `limit` (a hang guard).
  std::optional<member_event> wait_for(int rank, member_event::kind_t kind,
                                       std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu);
    std::optional<member_event> found;
    cv.wait_for(lock, limit, [&] {
      for (const auto& e : got)
        if (e.rank == rank && e.kind == kind) found = e;
      return found.has_value();
    });
    return found;
  }
};

// Removes a membership callback that refers to a function's locals on every way out.
struct callback_guard {
  node& n;
  int id;
  ~callback_guard() { n.remove_membership_callback(id); }
};

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
    // Waits to be killed or stopped by the test; the bound only ends a victim the test forgot.
    std::this_thread::sleep_for(120s);
    return 3;
  }
  member_events events;
  const int callback_id = n.on_membership([&](const member_event& e) { events.add(e); });
  callback_guard guard{n, callback_id};  // the callback refers to this frame
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
  if (auto e = events.wait_for(victim, member_event::lost, 60s); !e) {
    std::printf("UNEXPECTED: rank %d: no membership callback\n", me);
    bad = 1;
  } else {
    std::printf("membership callback: rank %d: rank %d lost: %s (epoch %llu)\n", me, e->rank,
                e->reason.c_str(), static_cast<unsigned long long>(e->epoch));
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

// -- roles: the job API, its errors and a role actor on a dying rank ---------------------------

struct add_request {
  std::vector<std::int64_t> xs;
  auto fields() { return std::tie(xs); }
};
struct add_reply {
  std::string who;
  std::int64_t sum = 0;
  auto fields() { return std::tie(who, sum); }
};
struct fail_request {
  std::string why;
  auto fields() { return std::tie(why); }
};
struct slow_request {
  std::int32_t ms = 0;
};
struct hold_request {  // answered once a release_request came to any actor of its rank
  std::uint8_t unused = 0;
};
struct release_request {
  std::uint8_t unused = 0;
};
struct unknown_request {
  std::int32_t x = 0;
};
struct checksum_request {
  std::uint8_t unused = 0;
};
struct die_request {
  std::uint8_t unused = 0;
};

std::uint64_t checksum(const std::uint8_t* p, std::size_t n) {
  std::uint64_t h = 1469598103934665603ull;
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// The gate hold_request waits at, one per process.
struct gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
};
gate& hold_gate() {
  static gate g;
  return g;
}

void make_calc(role_builder& b, role_context&) {
  auto last = std::make_shared<std::atomic<std::uint64_t>>(0);
  b.on<add_request>([](role_context& c, const add_request& r) {
    std::int64_t s = 0;
    for (auto x : r.xs) s += x;
    return add_reply{c.name(), s * (c.rank() + 1)};
  });
  b.on<fail_request>([](role_context&, const fail_request& r) -> int {
    throw std::runtime_error("refusing on purpose: " + r.why);
  });
  b.on<slow_request>([](role_context&, const slow_request& r) {
    std::this_thread::sleep_for(std::chrono::milliseconds(r.ms));
    return r.ms;
  });
  b.on<hold_request>([](role_context&, const hold_request&) {
    auto& g = hold_gate();
    std::unique_lock<std::mutex> lock(g.mu);
    // The bound only ends a hold that the driver never releases.
    return g.cv.wait_for(lock, 120s, [&] { return g.open; }) ? 1 : 0;
  });
  b.on<release_request>([](role_context&, const release_request&) {
    auto& g = hold_gate();
    std::lock_guard<std::mutex> lock(g.mu);
    g.open = true;
    g.cv.notify_all();
    return 0;
  });
  b.on<checksum_request>([last](role_context&, const checksum_request&) { return last->load(); });
  b.on<die_request>([](role_context&, const die_request&) {
    ::kill(::getpid(), SIGKILL);
    return 0;
  });
  b.on_tensor([last](role_context& c, const tensor_info& t) {
    auto r = c.receive(t, 30s);
    last->store(checksum(static_cast<const std::uint8_t*>(r.data.data()), t.bytes));
  });
}

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "NO ERROR";
}

int roles_driver(node& n) {
  job j(n);
  const int world = n.world_size();
  auto calcs = j.spawn_on_all("calc");
  int bad = 0;
  auto expect = [&](bool ok, const std::string& what) {
    std::printf("%s: %s\n", ok ? "check ok" : "CHECK FAILED", what.c_str());
    if (!ok) bad = 1;
  };
  // Fan-out and gather, in handle order.
  auto sums = j.ask_all<add_reply>(calcs, add_request{{1, 2, 3}}, 10s);
  bool sums_ok = static_cast<int>(sums.size()) == world;
  for (int r = 0; r < world && sums_ok; ++r)
    sums_ok = sums[r].sum == 6 * (r + 1) && sums[r].who == "calc@" + std::to_string(r);
  expect(sums_ok, "ask_all gathered " + std::to_string(sums.size()) + " replies in rank order");
  // A second actor of the same role on one rank gets a unique name; a taken name is refused.
  auto second = j.spawn("calc", 1);
  expect(second.name == "calc@1#1", "second calc on rank 1 is " + second.name);
  std::printf("duplicate name: %s\n", error_of([&] { j.spawn("calc", 1, "calc@1"); }).c_str());
  std::printf("unknown role: %s\n", error_of([&] { j.spawn("nope", 2); }).c_str());
  // Errors name the actor and its rank.
  std::printf("handler error: %s\n",
              error_of([&] { j.ask<int>(calcs[1], fail_request{"test"}, 10s); }).c_str());
  std::printf("unknown kind: %s\n",
              error_of([&] { j.ask<int>(calcs[2], unknown_request{}, 10s); }).c_str());
  std::printf("wrong reply type: %s\n",
              error_of([&] { j.ask<std::string>(calcs[1], slow_request{1}, 10s); }).c_str());
  // The handler holds until released, so the ask times out whatever the machine's load.
  std::printf("timeout: %s\n",
              error_of([&] { j.ask<std::int32_t>(calcs[2], hold_request{}, 200ms); }).c_str());
  // Released through a second actor on its rank (the first is busy holding): it replies late.
  j.ask<std::int32_t>(j.spawn("calc", 2), release_request{}, 10s);
  // A late reply does not confuse the next ask.
  expect(j.ask<std::int32_t>(calcs[2], slow_request{1}, 10s) == 1, "the ask after a timeout");
  // A tensor to a role actor, by handle.
  std::vector<std::uint8_t> data(3 << 20);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(i * 7 + 3);
  const std::int64_t shape[1] = {static_cast<std::int64_t>(data.size())};
  n.send_tensor(calcs[world - 1], data.data(), troupe::dtype::u8, shape, "to-role").wait(30s);
  // The send completes when the bytes left; the actor checksums them after. Polled (the actor
  // has nothing to wait on for that); the deadline only guards against a hang.
  std::uint64_t got = 0;
  for (const auto give_up = clock_type::now() + 60s; got == 0 && clock_type::now() < give_up;) {
    got = j.ask<std::uint64_t>(calcs[world - 1], checksum_request{}, 10s);
    if (got == 0) std::this_thread::sleep_for(10ms);
  }
  expect(got == checksum(data.data(), data.size()), "the role actor got the tensor byte-exact");
  // The same to a role actor on this rank: no transport, one copy when it receives.
  auto local = n.send_tensor(calcs[0], data.data(), troupe::dtype::u8, shape, "to-local-role");
  local.wait(30s);
  expect(
      j.ask<std::uint64_t>(calcs[0], checksum_request{}, 10s) == checksum(data.data(), data.size()),
      "the role actor on the driver's rank got the tensor byte-exact");
  // The last rank's actor kills its process: asks to it fail naming the rank.
  const role_handle victim = calcs[world - 1];
  member_events events;
  const int callback_id = n.on_membership([&](const member_event& e) { events.add(e); });
  callback_guard guard{n, callback_id};  // the callback refers to this frame
  j.try_ask_all<int>(std::span<const role_handle>(&victim, 1), die_request{}, 2000ms);
  if (n.lost_reason(victim.rank).empty()) events.wait_for(victim.rank, member_event::lost, 60s);
  std::printf("lost rank: %s\n",
              error_of([&] { j.ask<add_reply>(victim, add_request{}, 10s); }).c_str());
  auto partial = j.try_ask_all<add_reply>(calcs, add_request{{1}}, 10s);
  int answered = 0;
  for (auto& p : partial) answered += p ? 1 : 0;
  expect(answered == world - 1, "try_ask_all: " + std::to_string(answered) + " of " +
                                    std::to_string(world) + " answered after the loss");
  return bad;
}

int roles(node& n, role_registry&) {
  int rc = 0;
  if (n.rank() == 0) rc = roles_driver(n);
  // The survivors meet; a barrier that a loss interrupts fails, and is entered again.
  for (int attempt = 0;; ++attempt) {
    try {
      n.barrier("roles", 60s);
      break;
    } catch (const std::exception& e) {
      if (attempt >= 2) throw;
      std::printf("barrier interrupted: rank %d: %s\n", n.rank(), e.what());
    }
  }
  std::printf("roles done: rank %d\n", n.rank());
  return rc;
}

// -- rejoin: a new process takes the place of a killed rank ---------------------------------------

int rejoin(node& n) {
  const int me = n.rank();
  const std::size_t size = (1 << 20) + 4096;
  std::vector<std::uint8_t> out, in(size), expect;
  if (std::getenv("TROUPE_REPLACEMENT")) {
    std::string alive;
    for (int r : n.alive()) {
      alive += ' ';
      alive += std::to_string(r);
    }
    std::printf("replacement joined as rank %d: alive%s, epoch %llu\n", me, alive.c_str(),
                static_cast<unsigned long long>(n.epoch()));
    for (int peer : n.alive()) {
      if (peer == me) continue;
      auto info = n.next_tensor(30s, peer);
      n.receive(info, in.data(), in.size(), 30s);
      fill(expect, peer, size);
      if (in != expect) {
        std::printf("UNEXPECTED: replacement got a wrong tensor from rank %d\n", peer);
        return 1;
      }
      fill(out, me, size);
      const std::int64_t shape[1] = {static_cast<std::int64_t>(size)};
      n.send_tensor(peer, out.data(), troupe::dtype::u8, shape, "back").wait(30s);
    }
  } else if (me == 2) {
    std::printf("ready rank %d pid %d (victim)\n", me, static_cast<int>(::getpid()));
    // Waits to be killed by the test; the bound only ends a victim the test forgot.
    std::this_thread::sleep_for(120s);
    return 3;
  } else {
    member_events events;
    const int callback = n.on_membership([&](const member_event& e) { events.add(e); });
    callback_guard guard{n, callback};  // it refers to this frame
    std::printf("ready rank %d pid %d\n", me, static_cast<int>(::getpid()));
    if (!events.wait_for(2, member_event::lost, 60s)) {
      std::printf("UNEXPECTED: rank %d never saw rank 2 lost\n", me);
      return 1;
    }
    std::printf("saw rank 2 lost: rank %d\n", me);
    auto j = events.wait_for(2, member_event::joined, 120s);
    if (!j) {
      std::printf("UNEXPECTED: rank %d never saw rank 2 rejoin\n", me);
      return 1;
    }
    std::printf("saw rank 2 rejoin: rank %d: %s (epoch %llu)\n", me, j->reason.c_str(),
                static_cast<unsigned long long>(j->epoch));
    fill(out, me, size);
    const std::int64_t shape[1] = {static_cast<std::int64_t>(size)};
    auto send = n.send_tensor(2, out.data(), troupe::dtype::u8, shape, "to-new");
    auto info = n.next_tensor(30s, 2);
    n.receive(info, in.data(), in.size(), 30s);
    send.wait(30s);
    fill(expect, 2, size);
    if (in != expect) {
      std::printf("UNEXPECTED: rank %d got a wrong tensor from the new rank 2\n", me);
      return 1;
    }
  }
  n.barrier("rejoined", 60s);
  std::printf("rejoin ok rank %d\n", me);
  return 0;
}

int hold(node& n) {
  std::printf("ready rank %d pid %d\n", n.rank(), static_cast<int>(::getpid()));
  n.barrier("hold", 60s);
  std::printf("hold done: rank %d\n", n.rank());
  return 0;
}

// Rank 2 forges an announcement, then sends rank 0 a real tensor from the same actor: CAF keeps
// the order of one actor's messages to another, so once rank 0 has that tensor its node has
// handled the forgery. Then everyone exchanges as usual: the job went on.
int forge_announce(node& n) {
  auto& I = n.internals();
  const std::vector<std::uint8_t> bytes(16, 0x5a);
  const std::int64_t shape[1] = {16};
  if (n.rank() == 2) {
    caf::send_as(
        I.node_actor, I.peer(0),
        troupe::actors::msg::tensor_announce{
            1, 4242, 0, 0, static_cast<std::uint8_t>(troupe::dtype::u8), {16}, 16, "forged"});
    std::printf("forged: rank 2 announced a tensor as rank 1\n");
    n.send_tensor(0, bytes.data(), troupe::dtype::u8, shape, "after-forged").wait(60s);
  }
  if (n.rank() == 0) {
    std::vector<std::uint8_t> in(16);
    const tensor_info info = n.receive_next(2, in.data(), in.size(), 60s);
    bool from_1 = false;
    {
      std::lock_guard<std::mutex> lock(I.mu);
      for (const auto& t : I.inbox) from_1 = from_1 || t.source == 1;
    }
    std::printf(
        "rank 0: got \"%s\" from rank %d; refused announcements: %llu; a tensor from "
        "rank 1 waiting: %s\n",
        info.name.c_str(), info.source, static_cast<unsigned long long>(I.refused_announces.load()),
        from_1 ? "yes" : "no");
    if (info.name != "after-forged" || I.refused_announces.load() != 1 || from_1) return 1;
  }
  n.barrier("forged", 60s);
  return exchange(n);
}

std::string arg(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 2; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], name) == 0) return argv[i + 1];
  return fallback;
}

int guarded(node& n, const std::string& address_file) {
  if (n.rank() == 0) {
    auto* ucx = dynamic_cast<troupe::collective::ucx_transport*>(&n.transport());
    if (ucx == nullptr) return 1;
    static constexpr char hex[] = "0123456789abcdef";
    std::string text;
    for (std::uint8_t b : ucx->address()) {
      text += hex[b >> 4];
      text += hex[b & 15];
    }
    const std::string tmp = address_file + ".tmp";
    std::ofstream(tmp) << text << "\n";
    if (std::rename(tmp.c_str(), address_file.c_str()) != 0) return 1;
    std::printf("ucx address written\n");
    if (!ucx->await_refusals(1, 120s)) {
      std::printf("guarded FAILED: no handshake was refused\n");
      return 1;
    }
    for (const auto& line : ucx->refusals()) std::printf("refusal: %s\n", line.c_str());
  }
  n.barrier("guarded", 120s);
  return exchange(n);
}

int rogue_ucx(int argc, char** argv) {
  std::ifstream in(arg(argc, argv, "--address-file", ""));
  std::string text;
  in >> text;
  std::vector<std::uint8_t> address;
  for (std::size_t i = 0; i + 1 < text.size(); i += 2)
    address.push_back(static_cast<std::uint8_t>(std::stoi(text.substr(i, 2), nullptr, 16)));
  troupe::collective::ucx_transport_options o;
  o.rank = std::atoi(arg(argc, argv, "--claim", "1").c_str());
  o.size = std::atoi(arg(argc, argv, "--world", "2").c_str());
  o.token = "not-the-job-token";
  o.job = "rogue";
  o.handshake_timeout = 2s;
  troupe::collective::ucx_transport t(o);
  t.connect(0, address);
  std::vector<std::uint8_t> bytes(1024, 0xee);
  try {
    auto r = t.isend(0, tensor_tag(0, 0), bytes.data(), bytes.size());
    t.wait(r, 10s);
  } catch (const std::exception& e) {
    std::printf("rogue: refused: %s\n", e.what());
    return 0;
  }
  std::printf("rogue: its tensor was sent\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  std::setvbuf(stderr, nullptr, _IOLBF, 0);
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s exchange | loss --victim V | hold | roles\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  int victim = 1;
  for (int i = 2; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--victim") == 0) victim = std::atoi(argv[i + 1]);
  if (mode == "rogue-ucx") {
    try {
      return rogue_ucx(argc, argv);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "troupe_multirank_worker: rogue-ucx: %s\n", e.what());
      return 1;
    }
  }
  if (mode == "early-exit") {
    // Rank 1 fails before it joins; the others must not wait for it.
    const char* r = std::getenv("TROUPE_RANK");
    if (r && std::atoi(r) == 1) {
      std::printf("rank 1 gives up before joining\n");
      return 3;
    }
  }
  try {
    role_registry registry;
    registry.add("calc", make_calc);
    node_options options;
    options.roles = &registry;
    // Jobs that go on after a loss keep local endpoints isolated (see node_options).
    options.survive_local_loss = mode == "rejoin";
    node n(options);
    int rc = 2;
    if (mode == "exchange")
      rc = exchange(n);
    else if (mode == "loss")
      rc = loss(n, victim);
    else if (mode == "hold")
      rc = hold(n);
    else if (mode == "roles")
      rc = roles(n, registry);
    else if (mode == "early-exit")
      rc = hold(n);
    else if (mode == "rejoin")
      rc = rejoin(n);
    else if (mode == "forge-announce")
      rc = forge_announce(n);
    else if (mode == "guarded")
      rc = guarded(n, arg(argc, argv, "--address-file", "troupe-ucx-address"));
    else
      std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
    n.shutdown();
    return rc;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_multirank_worker: error: %s\n", e.what());
    return 1;
  }
}
