// The in-process transport: matching order, sizes, failures and timeouts, as transport.hpp states.
#include <catch2/catch.hpp>

#include <numeric>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "memory/error.hpp"

using namespace troupe;
using namespace troupe::collective;

TEST_CASE("local transport matches messages per source and tag in posting order",
          "[collective][local]") {
  local_world w(3);
  auto& a = w.transport(0);
  auto& b = w.transport(1);
  auto& c = w.transport(2);
  std::vector<int> out(6), got(6, -1);
  std::iota(out.begin(), out.end(), 10);
  // Two sends on tag 5 and one on tag 6 from rank 0; one on tag 5 from rank 2.
  auto s0 = a.isend(1, 5, &out[0], sizeof(int));
  auto s1 = a.isend(1, 5, &out[1], sizeof(int));
  auto s2 = a.isend(1, 6, &out[2], sizeof(int));
  auto s3 = c.isend(1, 5, &out[3], sizeof(int));
  REQUIRE_FALSE(a.test(s0));  // no eager buffering: the send waits for its receive
  // Receives posted in another order still match per (source, tag) in order.
  auto r_tag6 = b.irecv(0, 6, &got[2], sizeof(int));
  auto r_from2 = b.irecv(2, 5, &got[3], sizeof(int));
  auto r_first = b.irecv(0, 5, &got[0], sizeof(int));
  auto r_second = b.irecv(0, 5, &got[1], sizeof(int));
  for (auto* r : {&r_tag6, &r_from2, &r_first, &r_second}) b.wait(*r);
  for (auto* s : {&s0, &s1, &s2}) a.wait(*s);
  c.wait(s3);
  REQUIRE(got[0] == 10);
  REQUIRE(got[1] == 11);
  REQUIRE(got[2] == 12);
  REQUIRE(got[3] == 13);
  REQUIRE(a.bytes_sent() == 3 * sizeof(int));
  REQUIRE(b.bytes_received() == 4 * sizeof(int));
  REQUIRE(c.bytes_sent() == sizeof(int));
}

TEST_CASE("local transport moves large messages between threads byte exact",
          "[collective][local]") {
  local_world w(2);
  const std::size_t n = 3u << 20;
  std::vector<unsigned char> src(n), dst(n, 0);
  for (std::size_t i = 0; i < n; ++i) src[i] = static_cast<unsigned char>(i * 131 + 7);
  std::thread t([&] {
    auto r = w.transport(1).irecv(0, 1, dst.data(), n);
    w.transport(1).wait(r);
  });
  auto s = w.transport(0).isend(1, 1, src.data(), n);
  w.transport(0).wait(s);
  t.join();
  REQUIRE((src == dst));
  // Zero-byte messages complete too.
  auto z1 = w.transport(0).isend(1, 2, nullptr, 0);
  auto z2 = w.transport(1).irecv(0, 2, nullptr, 0);
  w.transport(0).wait(z1);
  w.transport(1).wait(z2);
}

TEST_CASE("local transport fails a size mismatch naming both sizes", "[collective][local]") {
  local_world w(2);
  char buf[16] = {};
  auto s = w.transport(0).isend(1, 3, buf, 16);
  auto r = w.transport(1).irecv(0, 3, buf, 8);
  REQUIRE_THROWS_WITH(w.transport(1).wait(r), Catch::Contains("16 bytes") &&
                                                  Catch::Contains("8 bytes") &&
                                                  Catch::Contains("rank 0"));
  REQUIRE_THROWS_WITH(w.transport(0).test(s), Catch::Contains("size mismatch"));
}

TEST_CASE("local transport wait times out naming the peer and leaves the request pending",
          "[collective][local]") {
  local_world w(2);
  int x = 0, y = 42;
  auto r = w.transport(0).irecv(1, 77, &x, sizeof(int));
  REQUIRE_THROWS_WITH(
      w.transport(0).wait(r, std::chrono::milliseconds(20)),
      Catch::Contains("timed out") && Catch::Contains("rank 1") && Catch::Contains("tag 77"));
  auto s = w.transport(1).isend(0, 77, &y, sizeof(int));
  w.transport(0).wait(r);
  w.transport(1).wait(s);
  REQUIRE(x == 42);
}

TEST_CASE("local world fail_peer fails pending and later requests naming the rank",
          "[collective][local]") {
  local_world w(3);
  int a = 0, b = 0;
  auto pending_recv = w.transport(0).irecv(2, 1, &a, sizeof(int));
  auto pending_send = w.transport(1).isend(2, 1, &b, sizeof(int));
  auto unrelated = w.transport(0).irecv(1, 1, &a, sizeof(int));
  std::string waiter_error;  // Catch assertions stay on the main thread
  std::thread waiter([&] {
    try {
      w.transport(0).wait(pending_recv);
    } catch (const troupe::error& e) {
      waiter_error = e.what();
    }
  });
  // Lets the waiter block first; not needed: a wait that starts after the failure fails the same.
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  w.fail_peer(2, "oom-killed");
  waiter.join();
  REQUIRE(waiter_error == "rank 2 lost: oom-killed");
  REQUIRE_THROWS_WITH(w.transport(1).wait(pending_send), "rank 2 lost: oom-killed");
  REQUIRE(w.transport(0).peer_failure(2) == "oom-killed");
  REQUIRE(w.transport(0).peer_failure(1).empty());
  // Later requests with the lost rank fail at once; the lost rank's own requests fail too.
  auto later = w.transport(1).irecv(2, 9, &a, sizeof(int));
  REQUIRE_THROWS_WITH(w.transport(1).test(later), "rank 2 lost: oom-killed");
  auto own = w.transport(2).isend(0, 9, &a, sizeof(int));
  REQUIRE_THROWS_WITH(w.transport(2).wait(own), Catch::Contains("rank 2 lost"));
  // Survivors still talk.
  int v = 5;
  auto s = w.transport(1).isend(0, 1, &v, sizeof(int));
  w.transport(0).wait(unrelated);
  w.transport(1).wait(s);
  REQUIRE(a == 5);
}

TEST_CASE("local transport rejects bad peers and tags", "[collective][local]") {
  local_world w(2);
  int x = 0;
  REQUIRE_THROWS_WITH(w.transport(0).isend(0, 1, &x, 4), Catch::Contains("peer 0"));
  REQUIRE_THROWS_WITH(w.transport(0).irecv(5, 1, &x, 4), Catch::Contains("peer 5"));
  REQUIRE_THROWS_WITH(w.transport(0).isend(1, max_tag + 1, &x, 4), Catch::Contains("max_tag"));
}
