// Tests of the snapshot renderings: JSON both ways, Prometheus text, the table and rates.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <sstream>

#include "actors/introspection/exposition_check.test.hpp"
#include "actors/introspection/render.hpp"
#include "actors/introspection/sample_snapshot.test.hpp"

using namespace troupe::actors;
using namespace troupe::actors::testing;

namespace {

std::size_t columns(const std::string& s) {
  std::size_t n = 0;
  for (char c : s) n += (c & 0xc0) != 0x80;
  return n;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  return lines;
}

}  // namespace

TEST_CASE("A snapshot survives JSON and back unchanged", "[introspection]") {
  job_snapshot s = sample_snapshot();
  s.actors[0].metrics["loss"] = std::numeric_limits<double>::quiet_NaN();  // written as null
  auto back = snapshot_from_json(to_json(s), "test");
  REQUIRE(back.has_value());
  check_equal(s, *back);
  // 2^63 + 1 is not a double: the counter must travel as an integer.
  CHECK(back->actors[1].bytes_sent == (1ull << 63) + 1);
}

TEST_CASE("An empty snapshot survives JSON and back", "[introspection]") {
  auto back = snapshot_from_json(to_json(job_snapshot{}), "empty");
  REQUIRE(back.has_value());
  check_equal(job_snapshot{}, *back);
}

TEST_CASE("Invalid UTF-8 in an actor name does not stop the JSON", "[introspection]") {
  job_snapshot s;
  s.actors.push_back(actor_state{});
  s.actors[0].name = "bad \xff\xfe name";
  std::string j;
  REQUIRE_NOTHROW(j = to_json(s));
  auto back = snapshot_from_json(j, "test");
  REQUIRE(back.has_value());
  CHECK(back->actors[0].name.find("bad ") == 0);
}

TEST_CASE("Bad snapshot JSON is refused naming the source and the field", "[introspection]") {
  auto a = snapshot_from_json("{\"job\": \"x\", \"actors\": [", "http://h:1/json");
  REQUIRE_FALSE(a.has_value());
  CHECK_THAT(a.error_message(), Catch::Contains("http://h:1/json") && Catch::Contains("JSON"));

  auto b = snapshot_from_json(R"({"actors": [{"name": "a"}, {"name": "b", "mailbox_depth": "3"}]})",
                              "snap.json");
  REQUIRE_FALSE(b.has_value());
  CHECK_THAT(b.error_message(),
             Catch::Contains("snap.json") && Catch::Contains("actors[1].mailbox_depth"));

  auto c = snapshot_from_json(R"({"members": {"rank": 1}})", "m");
  REQUIRE_FALSE(c.has_value());
  CHECK_THAT(c.error_message(), Catch::Contains("members") && Catch::Contains("array"));

  auto d = snapshot_from_json("[1, 2]", "arr");
  REQUIRE_FALSE(d.has_value());

  auto e = snapshot_from_json(R"({"members": [{"rank": 99999999999}]})", "big");
  REQUIRE_FALSE(e.has_value());
  CHECK_THAT(e.error_message(), Catch::Contains("members[0].rank"));

  // Unknown fields are ignored and missing ones keep their defaults.
  auto f = snapshot_from_json(R"({"job": "j", "future": 1, "actors": [{"name": "a"}]})", "f");
  REQUIRE(f.has_value());
  CHECK(f->job == "j");
  CHECK(f->actors.at(0).rank == -1);
}

TEST_CASE("Prometheus text of a snapshot follows the exposition grammar", "[introspection]") {
  job_snapshot s = sample_snapshot();
  std::string text = to_prometheus(s);
  exposition e = parse_exposition(text);
  INFO(text);
  REQUIRE(e.error.empty());
  CHECK(e.types.at("troupe_actor_mailbox_depth") == "gauge");
  CHECK(e.types.at("troupe_actor_bytes_sent_total") == "counter");
  CHECK(e.types.at("troupe_member_up") == "gauge");

  // Escaped label values read back as the original strings.
  const actor_state& odd = s.actors[2];
  CHECK(e.value("troupe_actor_mailbox_depth",
                {{"actor", odd.name}, {"role", "user role"}, {"rank", "2"}}) == 12345);
  CHECK(e.value("troupe_actor_metric",
                {{"actor", odd.name}, {"metric", "weird \"metric\"\nname"}}) == -4.5);
  CHECK(e.value("troupe_job_info", {{"name", "gpt2-\"small\""}}) == 1);
  CHECK(e.value("troupe_member_up", {{"rank", "0"}}) == 1);
  CHECK(e.value("troupe_member_up", {{"rank", "2"}}) == 0);
  CHECK(e.value("troupe_actor_bytes_received_total", {{"actor", "stage/1"}}) == double(3ull << 30));
  CHECK(e.value("troupe_actor_metric", {{"actor", "stage/1"}, {"metric", "third"}}) == 1.0 / 3.0);
  CHECK(e.value("troupe_actor_metric", {{"actor", "stage/1"}, {"metric", "tiny"}}) == 1e-300);
  CHECK(e.value("troupe_actor_info", {{"actor", "stage/1"}, {"mesh", "dp=0,pp=1"}}) == 1);
  std::size_t actor_samples = 0;
  for (const auto& x : e.samples) actor_samples += x.name == "troupe_actor_messages_sent_total";
  CHECK(actor_samples == s.actors.size());
}

TEST_CASE("Prometheus text writes NaN and infinities as the format spells them",
          "[introspection]") {
  job_snapshot s;
  actor_state a;
  a.name = "a";
  a.metrics = {{"nan", std::nan("")}, {"up", INFINITY}, {"down", -INFINITY}};
  s.actors.push_back(a);
  std::string text = to_prometheus(s);
  exposition e = parse_exposition(text);
  REQUIRE(e.error.empty());
  CHECK(std::isnan(e.value("troupe_actor_metric", {{"metric", "nan"}})));
  CHECK(text.find("metric=\"up\"} +Inf\n") != std::string::npos);
  CHECK(text.find("metric=\"down\"} -Inf\n") != std::string::npos);
}

TEST_CASE("The exposition checker rejects what the format forbids", "[introspection]") {
  // The checker must be able to fail, or the test above proves nothing.
  const std::string head = "# HELP m h\n# TYPE m gauge\n";
  CHECK(parse_exposition(head + "m 1\n").error.empty());
  CHECK(parse_exposition(head + "m{a=\"x\\\"y\"} 1\n").error.empty());
  CHECK_FALSE(parse_exposition("m 1\n").error.empty());                      // no TYPE
  CHECK_FALSE(parse_exposition(head + "m{a=\"x\"y\"} 1\n").error.empty());   // raw quote
  CHECK_FALSE(parse_exposition(head + "m{a=\"x\\ty\"} 1\n").error.empty());  // bad escape
  CHECK_FALSE(parse_exposition(head + "m{1a=\"x\"} 1\n").error.empty());     // label name
  CHECK_FALSE(parse_exposition(head + "m{a=\"x\"} one\n").error.empty());    // value
  CHECK_FALSE(parse_exposition(head + "m 1\nm 2\n").error.empty());          // duplicate
  CHECK_FALSE(parse_exposition("# HELP 9m h\n# TYPE 9m gauge\n9m 1\n").error.empty());
  CHECK_FALSE(parse_exposition(head + "m{a=\"x\n\"} 1\n").error.empty());  // raw newline
  CHECK_FALSE(parse_exposition(head + "m 1").error.empty());               // no final \n
}

TEST_CASE("The table shows every member and actor and fits the width", "[introspection]") {
  job_snapshot s = sample_snapshot();
  s.actors[2].name = "odd-actor";  // printable, to look for it verbatim
  for (int width : {80, 100, 200}) {
    INFO("width " << width);
    std::string t = render_table(s, width);
    for (const auto& a : s.actors) CHECK(t.find(a.name) != std::string::npos);
    for (const auto& l : lines_of(t)) CHECK(columns(l) <= std::size_t(width));
    CHECK(t.find("node-b") != std::string::npos);
    CHECK(t.find("lost: heartbeat timeout") != std::string::npos);
    CHECK(t.find("forward mb 3") != std::string::npos);
    CHECK(t.find("dp=0,pp=1") != std::string::npos);
  }
  std::string wide = render_table(s, 0);
  CHECK(wide.find("3.0 GiB") != std::string::npos);  // bytes in of stage/1
  CHECK(wide.find("1.10T") != std::string::npos);    // messages out of stage/1
  CHECK(wide.find("loss=2.312") != std::string::npos);
  CHECK(wide.find("tokens_per_s=1.512e+04") != std::string::npos);
  // Tiny widths cut but still produce lines no longer than asked.
  for (const auto& l : lines_of(render_table(s, 7))) CHECK(columns(l) <= 7);
}

TEST_CASE("The table cannot be used to send escape sequences to a terminal", "[introspection]") {
  job_snapshot s = sample_snapshot();
  s.actors[0].name = "evil\x1b[2J\x1b]0;title\x07";
  s.actors[1].activity = "line\nbreak\r";
  s.members[0].host =
      "h\xc2\x9b"
      "31m";  // C1 CSI in UTF-8
  std::string t = render_table(s, 0);
  for (char c : t) CHECK((static_cast<unsigned char>(c) >= 0x20 || c == '\n'));
  CHECK(t.find("\xc2\x9b") == std::string::npos);
  CHECK(t.find("evil?[2J") != std::string::npos);
  // Multi-byte characters are kept and counted as one column each.
  CHECK(t.find("naïve ✓") != std::string::npos);
}

TEST_CASE("Rates come from the difference of two snapshots", "[introspection]") {
  job_snapshot a = sample_snapshot(), b = a;
  b.actors[1].bytes_received += 4096;
  b.actors[1].bytes_sent += 1024;
  b.actors[1].messages_received += 10;
  b.actors[0].bytes_sent -= 1;  // went backwards: restarted, no rate
  b.actors.push_back(actor_state{});
  b.actors.back().name = "new";
  auto r = compute_rates(a, b, 2.0);
  REQUIRE(r.count("stage/1") == 1);
  CHECK(r["stage/1"].bytes_in_per_s == 2048);
  CHECK(r["stage/1"].bytes_out_per_s == 512);
  CHECK(r["stage/1"].msgs_in_per_s == 5);
  CHECK(r["stage/1"].msgs_out_per_s == 0);
  CHECK(r.count("coordinator") == 0);
  CHECK(r.count("new") == 0);
  CHECK(compute_rates(a, b, 0).empty());
  std::string t = render_table(b, 0, r);
  CHECK(t.find("2.0 KiB") != std::string::npos);
  CHECK(t.find("IN/s") != std::string::npos);
}

TEST_CASE("Byte counts and durations read like a person writes them", "[introspection]") {
  CHECK(human_bytes(0) == "0 B");
  CHECK(human_bytes(1023) == "1023 B");
  CHECK(human_bytes(1024) == "1.0 KiB");
  CHECK(human_bytes(1536) == "1.5 KiB");
  CHECK(human_bytes(5.0 * (1 << 30)) == "5.0 GiB");
  CHECK(human_bytes(1048575) == "1.0 MiB");
  CHECK(human_bytes(1023.7) == "1.0 KiB");
  CHECK(human_bytes(1e30) == "867361737988.4 EiB");
  CHECK(human_bytes(-1) == "-");
  CHECK(human_count(99999) == "99999");
  CHECK(human_count(123456) == "123k");
  CHECK(human_count(1099511627776ull) == "1.10T");
  CHECK(human_duration(0.25) == "0.2s");
  CHECK(human_duration(45) == "45s");
  CHECK(human_duration(723) == "12m03s");
  CHECK(human_duration(3 * 3600 + 4 * 60 + 5) == "3h04m");
  CHECK(human_duration(2 * 86400 + 3 * 3600) == "2d03h");
  CHECK(human_duration(std::nan("")) == "-");
}

TEST_CASE("The HTML page refreshes itself and escapes names", "[introspection]") {
  job_snapshot s = sample_snapshot();
  s.actors[0].name = "<script>alert(1)</script>";
  std::string h = render_html(s, 3);
  CHECK(h.find("http-equiv=\"refresh\" content=\"3\"") != std::string::npos);
  CHECK(h.find("<script>") == std::string::npos);
  CHECK(h.find("&lt;script&gt;") != std::string::npos);
  CHECK(h.find("stage/1") != std::string::npos);
}

TEST_CASE("Collective records are refused naming the field when their JSON is wrong",
          "[introspection]") {
  auto a = snapshot_from_json(R"({"actors": [{"name": "a", "collectives": [{"seq": "12"}]}]})",
                              "c.json");
  REQUIRE_FALSE(a.has_value());
  CHECK_THAT(a.error_message(),
             Catch::Contains("c.json") && Catch::Contains("actors[0].collectives[0].seq"));
  auto b = snapshot_from_json(R"({"actors": [{"name": "a", "collectives": {"seq": 1}}]})", "b");
  REQUIRE_FALSE(b.has_value());
  CHECK_THAT(b.error_message(), Catch::Contains("actors[0].collectives"));
  // A snapshot of an older troupe has no records: none are read.
  auto c = snapshot_from_json(R"({"actors": [{"name": "a"}]})", "old");
  REQUIRE(c.has_value());
  CHECK(c->actors.at(0).collectives.empty());
}

TEST_CASE("Prometheus text has the sequence numbers and unfinished ops of each communicator",
          "[introspection]") {
  job_snapshot s = sample_snapshot();
  std::string text = to_prometheus(s);
  exposition e = parse_exposition(text);
  INFO(text);
  REQUIRE(e.error.empty());
  CHECK(e.types.at("troupe_collective_last_seq") == "gauge");
  using labels = std::map<std::string, std::string>;
  const labels tp = {{"actor", "stage/1"}, {"communicator", "ucx:tp#3[0,1]"}};
  const labels dp = {{"actor", "stage/1"}, {"communicator", "ucx:dp#0[1,2]"}};
  const labels odd = {{"actor", s.actors[2].name}, {"communicator", "odd \"comm\"\n"}};
  // tp: #11 done, #12 running, #13 issued.
  CHECK(e.value("troupe_collective_last_seq", tp) == 13);
  CHECK(e.value("troupe_collective_last_completed_seq", tp) == 11);
  CHECK(e.value("troupe_collective_unfinished", tp) == 2);
  CHECK(e.value("troupe_collective_oldest_unfinished_seconds", tp) == 2.125);
  CHECK(e.value("troupe_collective_last_seq", dp) == 4);
  CHECK(e.value("troupe_collective_last_completed_seq", dp) == 4);
  CHECK(e.value("troupe_collective_unfinished", dp) == 0);
  CHECK(e.value("troupe_collective_oldest_unfinished_seconds", dp) == 0);
  // A failed op counts as finished.
  CHECK(e.value("troupe_collective_last_completed_seq", odd) == 7);
  CHECK(e.value("troupe_collective_unfinished", odd) == 0);
  std::size_t n = 0;
  for (const auto& x : e.samples) n += x.name == "troupe_collective_unfinished";
  CHECK(n == 3);  // one per actor and communicator; the coordinator watches none
}

TEST_CASE("The table names the oldest unfinished collective of each actor", "[introspection]") {
  job_snapshot s = sample_snapshot();
  const auto& stage = s.actors[1];
  const collective_op* key = key_collective(stage);
  REQUIRE(key != nullptr);
  CHECK(key->seq == 12);  // not #13, issued later behind it
  CHECK(key_collective(s.actors[0]) == nullptr);
  CHECK(collective_text(*key) == "allreduce #12 running 2.1s on ucx:tp#3[0,1]");
  CHECK(collective_text(s.actors[1].collectives[0]) ==
        "allreduce #11 done in 500us on ucx:tp#3[0,1]");
  CHECK(collective_text(s.actors[2].collectives[0]) ==
        "send #7 failed on odd \"comm\"\n: rank 2 lost: process exited");

  std::string wide = render_table(s, 0);
  INFO(wide);
  CHECK(wide.find("COLLECTIVE") != std::string::npos);
  CHECK(wide.find("allreduce #12 running 2.1s on ucx:tp#3[0,1] (+1 unfinished)") !=
        std::string::npos);
  CHECK(wide.find("send #7 failed on odd \"comm\"?: rank 2 lost") != std::string::npos);
  // Narrow terminals keep the start of the cell: the op, its number and its state.
  for (int width : {100, 140}) {
    std::string t = render_table(s, width);
    INFO(t);
    for (const auto& l : lines_of(t)) CHECK(columns(l) <= std::size_t(width));
    CHECK(t.find("allreduce #12 runn") != std::string::npos);
  }

  // With nothing unfinished the last op to finish is shown.
  actor_state a;
  a.collectives = {{"c", 1, "allreduce", "f32", 1, -1, "done", 0, 100, 9.0},
                   {"c", 2, "barrier", "f32", 0, -1, "done", 200, 5000, 8.0},
                   {"c", 3, "recv", "f32", 4, 1, "done", 300, 400, 8.5}};
  REQUIRE(key_collective(a) != nullptr);
  CHECK(key_collective(a)->seq == 2);  // ended 8.0 - 0.0048 s ago, the others earlier
  CHECK(collective_text(*key_collective(a)) == "barrier #2 done in 4.8ms on c");
}

TEST_CASE("Every collective record is listed for ps and the page", "[introspection]") {
  job_snapshot s = sample_snapshot();
  std::string t = render_collectives(s, 0);
  INFO(t);
  auto lines = lines_of(t);
  REQUIRE(lines.size() == 1 + 5);  // header and five records
  CHECK(lines[0].find("COMMUNICATOR") != std::string::npos);
  CHECK(lines[1].find("ucx:tp#3[0,1]") != std::string::npos);
  CHECK(lines[2].find("running") != std::string::npos);
  CHECK(lines[4].find("all_gather") != std::string::npos);
  CHECK(lines[4].find("1.10T") != std::string::npos);  // the count
  CHECK(lines[5].find("failed: rank 2 lost") != std::string::npos);
  for (const auto& l : lines_of(render_collectives(s, 60))) CHECK(columns(l) <= 60);
  CHECK(render_collectives(job_snapshot{}, 0) == "(no collectives)\n");
  std::string h = render_html(s, 2);
  CHECK(h.find("recent collectives") != std::string::npos);
  CHECK(h.find("broadcast") != std::string::npos);
  CHECK(h.find("odd &quot;comm&quot;") != std::string::npos);
}
