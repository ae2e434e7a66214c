// The coordinator's admission rules, seen from a raw CAF peer in this process: a wrong token, a
// rank outside the world or twice, and messages from actors that never joined.
#include <catch2/catch.hpp>

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <chrono>
#include <mutex>
#include <string>
#include <vector>

#include "actors/caf_system.hpp"
#include "actors/coordinator.hpp"

namespace {

using namespace troupe::actors;
using namespace std::chrono_literals;

struct log_lines {
  std::mutex mu;
  std::vector<std::string> lines;
  int count(const std::string& needle) {
    std::lock_guard<std::mutex> lock(mu);
    int n = 0;
    for (const auto& l : lines)
      if (l.find(needle) != std::string::npos) ++n;
    return n;
  }
};

// The unused argument: CAF 0.17 binds a reference to a null empty tuple otherwise (UBSan).
caf::behavior dummy_node(caf::event_based_actor*, int) {
  return {[](msg::coordinator_beat&) {}, [](msg::member_lost&) {},
          [](msg::describe_atom) { return std::vector<actor_state>{}; }};
}

}  // namespace

TEST_CASE("The coordinator admits only the job token and ignores actors that never joined") {
  auto log = std::make_shared<log_lines>();
  coordinator_options o;
  o.job = "unit-coordinator";
  o.token = "right-token";
  o.world_size = 2;
  o.serve_http = false;
  o.register_job = false;
  o.log = [log](const std::string& line) {
    std::lock_guard<std::mutex> lock(log->mu);
    log->lines.push_back(line);
  };
  coordinator c(o);
  REQUIRE(c.port() > 0);

  auto cfg = detail::make_caf_config(1);
  caf::actor_system sys{*cfg};
  {
    auto coord = sys.middleman().remote_actor("127.0.0.1", c.port());
    REQUIRE(coord);
    auto node = sys.spawn(dummy_node, 0);
    caf::scoped_actor self{sys};
    auto join = [&](std::string token, int rank, std::chrono::milliseconds timeout) {
      msg::join_request req;
      req.token = std::move(token);
      req.rank = rank;
      req.world_size = 2;
      req.host = "testhost";
      req.pid = 4242;
      req.endpoint_host = "127.0.0.1";
      req.endpoint_port = 1;
      req.node = node;
      msg::join_reply rep;
      std::string failure;
      self->request(*coord, timeout, req)
          .receive([&](msg::join_reply& r) { rep = std::move(r); },
                   [&](caf::error& e) { failure = sys.render(e); });
      return std::make_pair(rep, failure);
    };

    auto [wrong, f1] = join("wrong-token", 0, 5s);
    REQUIRE(f1.empty());
    CHECK_FALSE(wrong.accepted);
    CHECK(wrong.reason == "wrong job token");
    CHECK(log->count("refused rank 0 (host testhost, pid 4242): wrong job token") == 1);

    // Not a member: ignored, logged once for that process, and a barrier is answered with a no.
    self->send(*coord, msg::heartbeat{0, 1});
    msg::barrier_reply b;
    self->request(*coord, 5s, msg::barrier_request{0, "b"})
        .receive([&](msg::barrier_reply& r) { b = std::move(r); }, [](caf::error&) {});
    CHECK_FALSE(b.ok);
    CHECK(b.error.find("not a member") != std::string::npos);
    CHECK(log->count("not a member of the job") == 1);
    CHECK(c.joined() == 0);

    auto [outside, f2] = join("right-token", 5, 5s);
    CHECK_FALSE(outside.accepted);
    CHECK(outside.reason.find("outside the job's world of 2 ranks") != std::string::npos);

    // The right token for rank 0: admitted, and the answer waits for the whole world.
    auto [pending, f3] = join("right-token", 0, 300ms);
    CHECK(!f3.empty());
    CHECK(c.joined() == 1);
    auto [twice, f4] = join("right-token", 0, 5s);
    CHECK_FALSE(twice.accepted);
    CHECK(twice.reason.find("rank 0 already joined from host testhost") != std::string::npos);

    auto snap = c.snapshot(500ms);
    REQUIRE(snap.members.size() == 2);
    CHECK(snap.members[0].status == "joining");
    CHECK(snap.members[1].status == "absent");
    CHECK(snap.job == "unit-coordinator");
    caf::anon_send_exit(node, caf::exit_reason::user_shutdown);
  }
}
