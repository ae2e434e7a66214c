// A job snapshot with awkward content (quotes, backslashes, newlines, UTF-8, 64-bit counters,
// a hanging collective) and a field-by-field comparison, shared by the introspection tests.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>

#include "actors/introspection/snapshot.hpp"

namespace troupe::actors::testing {

inline job_snapshot sample_snapshot() {
  job_snapshot s;
  s.job = "gpt2-\"small\"";
  s.world_size = 3;
  s.uptime_s = 3725.25;
  s.members = {{0, "node-a", 4101, "alive", 0.125},
               {1, "node-b", 4102, "alive", 1.5},
               {2, "node-c", 4103, "lost: heartbeat timeout", 31.0}};
  actor_state coord;
  coord.name = "coordinator";
  coord.role = "coordinator";
  coord.rank = 0;
  coord.activity = "step 120";
  coord.messages_sent = 9000;
  coord.messages_received = 8990;
  coord.bytes_sent = 1234567;
  coord.bytes_received = 7654321;
  coord.uptime_s = 3725.0;
  coord.metrics = {{"loss", 2.3125}, {"step", 120}, {"tokens_per_s", 15123.5}};
  actor_state stage;
  stage.name = "stage/1";
  stage.role = "stage";
  stage.rank = 1;
  stage.mesh = {{"dp", 0}, {"pp", 1}};
  stage.activity = "forward mb 3";
  stage.mailbox_depth = 2;
  stage.messages_sent = 1ull << 40;
  stage.messages_received = 77;
  stage.bytes_sent = (1ull << 63) + 1;  // not representable as a double
  stage.bytes_received = 3ull << 30;
  stage.uptime_s = 0.1;
  stage.metrics = {{"tiny", 1e-300}, {"third", 1.0 / 3.0}};
  // A tensor-parallel allreduce that hangs (#12) behind a finished one, and a quiet dp group.
  stage.collectives = {
      {"ucx:tp#3[0,1]", 11, "allreduce", "f32", 1024, -1, "done", 1000.0, 1500.0, 3.0},
      {"ucx:tp#3[0,1]", 12, "allreduce", "f32", 1024, -1, "running", 1600.0, 0.0, 2.125},
      {"ucx:tp#3[0,1]", 13, "broadcast", "f32", 16, 0, "issued", 1700.0, 0.0, 2.0},
      {"ucx:dp#0[1,2]", 4, "all_gather", "bf16", 1ull << 40, -1, "done", 10.0, 45.0, 7.5}};
  stage.history = {{119, 3700.5, {{"loss", 2.5}, {"tokens_per_s", 15000.0}, {"bubble", 0.25}}},
                   {120, 3701.0, {{"loss", 2.3125}, {"memory.host_bytes", 3.0 * (1 << 30)}}}};
  actor_state odd;
  odd.name = "odd \"quoted\" \\ back\nslash";
  odd.role = "user role";
  odd.rank = 2;
  odd.mesh = {{"ep", 3}};
  odd.activity = "naïve ✓ — waiting";
  odd.mailbox_depth = 12345;
  odd.metrics = {{"weird \"metric\"\nname", -4.5}};
  odd.collectives = {{"odd \"comm\"\n", 7, "send", "u8", 3, 2,
                      "failed: rank 2 lost: process exited", 5.0, 900.0, 60.0}};
  s.actors = {coord, stage, odd};
  s.events = {{0.5, 0, 0, "joined", "rank 0 (host node-a, pid 4101) joined (1 of 3)"},
              {1.25, 1, -1, "started", "all 3 ranks joined and connected"},
              {3000.0, 2, 2, "lost", "rank 2 (host \"node-c\") lost: heartbeat timeout\n"}};
  s.event_counts = {{"joined", 3}, {"lost", 1}, {"recovery", (1ull << 63) + 1}};
  return s;
}

inline bool same_number(double a, double b) {
  return a == b || (std::isnan(a) && std::isnan(b));
}

inline void check_equal(const job_snapshot& a, const job_snapshot& b) {
  CHECK(a.job == b.job);
  CHECK(a.world_size == b.world_size);
  CHECK(same_number(a.uptime_s, b.uptime_s));
  REQUIRE(a.members.size() == b.members.size());
  for (std::size_t i = 0; i < a.members.size(); ++i) {
    INFO("member " << i);
    CHECK(a.members[i].rank == b.members[i].rank);
    CHECK(a.members[i].host == b.members[i].host);
    CHECK(a.members[i].pid == b.members[i].pid);
    CHECK(a.members[i].status == b.members[i].status);
    CHECK(same_number(a.members[i].last_heartbeat_age_s, b.members[i].last_heartbeat_age_s));
  }
  REQUIRE(a.actors.size() == b.actors.size());
  for (std::size_t i = 0; i < a.actors.size(); ++i) {
    const auto &x = a.actors[i], &y = b.actors[i];
    INFO("actor " << i << " " << x.name);
    CHECK(x.name == y.name);
    CHECK(x.role == y.role);
    CHECK(x.rank == y.rank);
    CHECK(x.mesh == y.mesh);
    CHECK(x.activity == y.activity);
    CHECK(x.mailbox_depth == y.mailbox_depth);
    CHECK(x.messages_sent == y.messages_sent);
    CHECK(x.messages_received == y.messages_received);
    CHECK(x.bytes_sent == y.bytes_sent);
    CHECK(x.bytes_received == y.bytes_received);
    CHECK(same_number(x.uptime_s, y.uptime_s));
    REQUIRE(x.collectives.size() == y.collectives.size());
    for (std::size_t k = 0; k < x.collectives.size(); ++k) {
      const auto &c = x.collectives[k], &d = y.collectives[k];
      INFO("collective " << k);
      CHECK(c.communicator == d.communicator);
      CHECK(c.seq == d.seq);
      CHECK(c.op == d.op);
      CHECK(c.dtype == d.dtype);
      CHECK(c.count == d.count);
      CHECK(c.peer == d.peer);
      CHECK(c.state == d.state);
      CHECK(same_number(c.start_us, d.start_us));
      CHECK(same_number(c.end_us, d.end_us));
      CHECK(same_number(c.age_s, d.age_s));
    }
    REQUIRE(x.history.size() == y.history.size());
    for (std::size_t k = 0; k < x.history.size(); ++k) {
      INFO("history " << k);
      CHECK(x.history[k].step == y.history[k].step);
      CHECK(same_number(x.history[k].uptime_s, y.history[k].uptime_s));
      CHECK(x.history[k].values == y.history[k].values);
    }
    REQUIRE(x.metrics.size() == y.metrics.size());
    for (const auto& [k, v] : x.metrics) {
      INFO("metric " << k);
      REQUIRE(y.metrics.count(k) == 1);
      CHECK(same_number(v, y.metrics.at(k)));
    }
  }
  REQUIRE(a.events.size() == b.events.size());
  for (std::size_t i = 0; i < a.events.size(); ++i) {
    INFO("event " << i);
    CHECK(same_number(a.events[i].uptime_s, b.events[i].uptime_s));
    CHECK(a.events[i].epoch == b.events[i].epoch);
    CHECK(a.events[i].rank == b.events[i].rank);
    CHECK(a.events[i].kind == b.events[i].kind);
    CHECK(a.events[i].detail == b.events[i].detail);
  }
  CHECK(a.event_counts == b.event_counts);
}

}  // namespace troupe::actors::testing
