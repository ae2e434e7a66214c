// Deadlines on the local backend: an op that a rank never joins fails at the communicator's
// deadline with the flight recorder's view (op, sequence number, what it moves, the group, which
// rank it waits for, whose messages arrived), and the communicator is aborted so nothing queued
// behind it waits. Deadlines are tiny and the tests wait for the failure, never for time.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "memory/error.hpp"

using namespace troupe;
using namespace troupe::collective;
using namespace std::chrono_literals;

namespace {

using comm_list = std::vector<std::unique_ptr<communicator>>;

std::string error_of(work w) {
  try {
    w.wait();
  } catch (const troupe::error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

comm_list group_with_deadline(int n, std::chrono::milliseconds deadline) {
  comm_list comms = make_local_group(n);
  for (auto& c : comms) c->set_timeout(deadline);
  return comms;
}

}  // namespace

TEST_CASE("an allreduce one rank never joins fails at the deadline naming that rank",
          "[collective][faults]") {
  comm_list comms = group_with_deadline(2, 50ms);
  std::vector<float> a(1000, 1.0f), b(10, 1.0f);
  work stuck = comms[0]->allreduce(a.data(), a.size(), dtype::f32);  // rank 1 never joins
  work queued = comms[0]->allreduce(b.data(), b.size(), dtype::f32);
  const std::string e = error_of(stuck), q = error_of(queued);
  INFO(e << "\n" << q);
  CHECK(e.rfind("allreduce #1 on local#0[0,1] failed: deadline of 50 ms passed (waited ", 0) == 0);
  CHECK(has(e, "f32 x 1000, group ranks 0,1): rank 0 is waiting for rank 1 (its message of "));
  CHECK(has(e, "no message of this op has arrived from any rank"));
  // The communicator is aborted: what was queued behind the stuck op fails pointing to it.
  CHECK(q.rfind("allreduce #2 on local#0[0,1] failed: aborted: rank 0 gave up allreduce #1 on "
                "local#0[0,1] at its deadline, waiting for rank 1",
                0) == 0);
  // So does every later op, at once.
  CHECK(has(error_of(comms[0]->barrier()), "aborted: rank 0 gave up allreduce #1"));
  auto rec = comms[0]->recent();
  REQUIRE(rec.size() == 3);
  CHECK(rec[0].state.rfind("failed: deadline of 50 ms passed", 0) == 0);
  std::printf("faults: a stuck collective (local, 2 ranks) -> refused: %s\n", e.c_str());
}

TEST_CASE("a barrier that one of three ranks never joins fails on both others naming it",
          "[collective][faults]") {
  comm_list comms = group_with_deadline(3, 100ms);
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] { errors[r] = error_of(comms[r]->barrier()); });
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    CHECK(errors[r].rfind("barrier #1 on local#0[0,1,2] failed: deadline of 100 ms passed", 0) ==
          0);
    CHECK(has(errors[r],
              "group ranks 0,1,2): rank " + std::to_string(r) + " is waiting for rank 2 ("));
  }
  // Rank 1 heard from rank 0 in the first round (0 -> 1), then waited for rank 2 in the second
  // (its send to rank 2 is not taken, as local sends complete when matched).
  CHECK(has(errors[1], "messages of this op arrived from rank 0"));
}

TEST_CASE("a recv whose sender never sends fails at the deadline naming the sender",
          "[collective][faults]") {
  comm_list comms = group_with_deadline(2, 50ms);
  std::vector<float> a(16);
  const std::string e = error_of(comms[1]->recv(a.data(), a.size(), dtype::f32, 0));
  INFO(e);
  CHECK(e.rfind("recv #1 on local#0[0,1] failed: deadline of 50 ms passed (waited ", 0) == 0);
  CHECK(has(e,
            "f32 x 16, group ranks 0,1): rank 1 is waiting for rank 0 (its message of 64 "
            "bytes has not arrived)"));
  CHECK(has(error_of(comms[1]->send(a.data(), a.size(), dtype::f32, 0)),
            "aborted: rank 1 gave up recv #1 on local#0[0,1] at its deadline"));
}

TEST_CASE("an op's own timeout wins over the communicator's deadline", "[collective]") {
  comm_list comms = make_local_group(2);  // the default deadline: default_op_timeout
  std::vector<float> a(10);
  options o;
  o.timeout = 50ms;
  const std::string e = error_of(comms[1]->allreduce(a.data(), a.size(), dtype::f32, o));
  INFO(e);
  CHECK(e.rfind("allreduce #1 on local#0[0,1] failed: deadline of 50 ms passed", 0) == 0);
  CHECK(has(e, "rank 1 is waiting for rank 0"));
}

TEST_CASE("a healthy op well inside its deadline completes and keeps the communicator usable",
          "[collective]") {
  comm_list comms = group_with_deadline(2, 60000ms);
  std::vector<std::vector<float>> a(2, std::vector<float>(100, 1.0f));
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      errors[r] = error_of(comms[r]->allreduce(a[r].data(), a[r].size(), dtype::f32));
      if (errors[r].empty()) errors[r] = error_of(comms[r]->barrier());
    });
  for (auto& t : threads) t.join();
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  CHECK(a[0][0] == 2.0f);
  CHECK(a[1][99] == 2.0f);
}

TEST_CASE("set_timeout refuses a negative deadline naming the communicator", "[collective]") {
  comm_list comms = make_local_group(1);
  CHECK_THROWS_WITH(comms[0]->set_timeout(-1ms),
                    Catch::Contains("set_timeout on local#0[0]: negative deadline -1 ms"));
}
