// The dashboard page as the endpoint serves it, and the data it reads from /json: role actors'
// step histories and the coordinator's membership log. (tests/multirank/dashboard.test.cpp loads
// the page of a training job in Chromium.)
#include <catch2/catch.hpp>

#include <atomic>
#include <regex>
#include <string>
#include <vector>

#include "actors/introspection/dashboard.hpp"
#include "actors/introspection/http_client.hpp"
#include "actors/introspection/http_server.hpp"
#include "actors/introspection/render.hpp"
#include "actors/introspection/sample_snapshot.test.hpp"
#include "actors/one_rank_job.hpp"

using namespace troupe::actors;
using namespace troupe::actors::testing;
using namespace std::chrono_literals;

namespace {

http_response get(const http_server& s, const std::string& path) {
  auto r = http_exchange(
      "127.0.0.1", s.port(),
      "GET " + path + " HTTP/1.1\r\nHost: " + s.endpoint() + "\r\nConnection: close\r\n\r\n", 5s);
  REQUIRE(r.has_value());
  return *r;
}

struct record_steps {
  std::int64_t from = 1, to = 0;  // records steps from..to
  auto fields() { return std::tie(from, to); }
};

void add_stepper_role(role_registry& roles) {
  roles.add("stepper", [](role_builder& b, role_context&) {
    b.on<record_steps>([](role_context& c, const record_steps& r) {
      for (std::int64_t s = r.from; s <= r.to; ++s)
        c.record_step(s, {{"loss", 10.0 / static_cast<double>(s)}, {"memory.host_bytes", 4096.0}});
      return r.to;
    });
  });
}

}  // namespace

TEST_CASE("The endpoint serves the dashboard at / without taking a snapshot", "[introspection]") {
  std::atomic<int> calls{0};
  http_server server([&] {
    ++calls;
    return sample_snapshot();
  });
  auto page = get(server, "/");
  CHECK(page.status == 200);
  CHECK_THAT(page.headers["content-type"], Catch::StartsWith("text/html"));
  CHECK(page.body == std::string(dashboard_html()));
  CHECK(calls == 0);  // a static page: the data comes from /json
  for (const char* chart : {"loss", "tokens_per_s", "grad_norm", "memory", "bubble", "collectives"})
    CHECK(page.body.find("data-chart=\"" + std::string(chart) + "\"") != std::string::npos);
  // It fetches nothing but the endpoint's own json: no scripts, styles or images from elsewhere.
  const std::regex fetch_call("fetch\\(([^,)]*)");
  int fetches = 0;
  for (auto it = std::sregex_iterator(page.body.begin(), page.body.end(), fetch_call);
       it != std::sregex_iterator(); ++it, ++fetches)
    CHECK((*it)[1] == "\"json\"");
  CHECK(fetches == 1);
  for (const char* outside : {"src=", "@import", "url(", "XMLHttpRequest", "WebSocket", "https:"})
    CHECK(page.body.find(outside) == std::string::npos);
  const std::regex http_url("http://[^\"]*");
  for (auto it = std::sregex_iterator(page.body.begin(), page.body.end(), http_url);
       it != std::sregex_iterator(); ++it)
    CHECK((*it)[0] == "http://www.w3.org/2000/svg");  // the SVG namespace, not a fetch
  // The text table moved to /table.
  auto table = get(server, "/table");
  CHECK(table.status == 200);
  CHECK(table.body.find("stage/1") != std::string::npos);
  CHECK(calls == 1);
}

TEST_CASE("Recorded steps and membership events reach the snapshot, the latest ones kept",
          "[introspection]") {
  one_rank_job w(add_stepper_role, "dashboard-history-test");
  job jb(*w.n);
  auto h = jb.spawn("stepper", 0);
  const std::int64_t limit = role_context::step_history_limit;
  // Until the history is full every step is there.
  CHECK(jb.ask<std::int64_t>(h, record_steps{1, limit}, 10s) == limit);
  job_snapshot snap;
  const actor_state* a = w.find(h.name, snap);
  REQUIRE(a);
  REQUIRE(a->history.size() == static_cast<std::size_t>(limit));
  for (std::int64_t i = 0; i < limit; ++i) CHECK(a->history[i].step == i + 1);
  CHECK(a->history.back().values.at("loss") == Approx(10.0 / static_cast<double>(limit)));
  CHECK(a->history.back().values.at("memory.host_bytes") == 4096.0);
  CHECK(a->history.front().uptime_s <= a->history.back().uptime_s);
  // Then it spans the run at an even stride, from the first step to the latest.
  const std::int64_t n = 10 * limit + 7;
  CHECK(jb.ask<std::int64_t>(h, record_steps{limit + 1, n}, 10s) == n);
  a = w.find(h.name, snap);
  REQUIRE(a);
  const auto& hist = a->history;
  INFO("history of " << hist.size() << " steps");
  CHECK(hist.size() <= static_cast<std::size_t>(limit));
  CHECK(hist.size() >= static_cast<std::size_t>(limit / 2));
  CHECK(hist.front().step == 1);
  CHECK(hist.back().step == n);
  const std::int64_t stride = hist[1].step - hist[0].step;
  CHECK(stride >= 8);
  CHECK((stride & (stride - 1)) == 0);
  for (std::size_t i = 1; i + 1 < hist.size(); ++i)
    CHECK(hist[i].step - hist[i - 1].step == stride);
  CHECK(hist.back().step - hist[hist.size() - 2].step <= stride);
  CHECK(a->metrics.at("step") == static_cast<double>(n));  // the latest, for troupe ps
  // The coordinator's log: the rank joined, then the job started (epoch 1).
  REQUIRE(snap.events.size() >= 2);
  CHECK(snap.events[0].kind == "joined");
  CHECK(snap.events[0].rank == 0);
  CHECK(snap.events[1].kind == "started");
  CHECK(snap.events[1].rank == -1);
  CHECK(snap.events[1].epoch == 1);
  CHECK(snap.events[1].detail.find("joined and connected") != std::string::npos);
  // And both survive /json.
  auto back = snapshot_from_json(to_json(snap), "test");
  REQUIRE(back.has_value());
  check_equal(snap, *back);
}

TEST_CASE("A member's recovery line reaches the event log, its count and Prometheus",
          "[introspection]") {
  one_rank_job w(add_stepper_role, "dashboard-event-test");
  const std::string line = "elastic: rank 3 (dp 1, pp 1) lost in step 7; rank 4 took its place";
  w.n->note_event("recovery", line);
  w.n->note_event("recovery", line + " again");
  // Kinds the coordinator writes itself are not a member's to note.
  try {
    w.n->note_event("lost", "rank 0 lost: a forged line");
    FAIL("a member noted a 'lost' event");
  } catch (const troupe::error& e) {
    CHECK(std::string(e.what()).find("note_event(\"lost\") refused") != std::string::npos);
  }
  job_snapshot snap;
  w.find("none", snap);
  std::vector<membership_event> recoveries;
  for (const auto& e : snap.events)
    if (e.kind == "recovery") recoveries.push_back(e);
  REQUIRE(recoveries.size() == 2);
  CHECK(recoveries[0].rank == 0);
  CHECK(recoveries[0].detail == line);
  CHECK(recoveries[1].detail == line + " again");
  for (const auto& e : snap.events) CHECK(e.kind != "lost");
  CHECK(snap.event_counts.at("recovery") == 2);
  CHECK(snap.event_counts.at("joined") == 1);
  CHECK(snap.event_counts.count("lost") == 0);
  const std::string text = to_prometheus(snap);
  CHECK(text.find("troupe_job_events_total{kind=\"recovery\"} 2") != std::string::npos);
  auto back = snapshot_from_json(to_json(snap), "test");
  REQUIRE(back.has_value());
  check_equal(snap, *back);
}
