// The flight recorder through introspection: which records a describe answer keeps, and a real
// two-rank job in this process (a coordinator, two nodes on threads, UCX and CAF on loopback) whose
// role actors and nodes watch communicators; their records reach the coordinator's snapshot, the
// HTTP endpoint's JSON and Prometheus text and the table, a stuck allreduce included.
#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "actors/coordinator.hpp"
#include "actors/introspection/exposition_check.test.hpp"
#include "actors/introspection/http_client.hpp"
#include "actors/introspection/render.hpp"
#include "actors/node.hpp"
#include "actors/node_impl.hpp"
#include "actors/roles.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"

namespace {

using namespace troupe;
using namespace troupe::actors;
using namespace troupe::actors::testing;
using namespace std::chrono_literals;
using collective::flight_record;
using collective::op_kind;

flight_record rec(std::uint64_t seq, const char* state, double start_us, double end_us = 0) {
  flight_record r;
  r.seq = seq;
  r.kind = seq % 2 ? op_kind::allreduce : op_kind::send;
  r.count = 10 * seq;
  r.peer = seq % 2 ? -1 : 1;
  r.state = state;
  r.start_us = start_us;
  r.end_us = end_us;
  return r;
}

std::vector<std::uint64_t> seqs(const std::vector<collective_op>& ops) {
  std::vector<std::uint64_t> out;
  for (const auto& o : ops) out.push_back(o.seq);
  return out;
}

// -- the role the job test runs: a communicator over ranks {0, 1}, watched, and allreduces.

struct make_comm_request {
  std::uint32_t group_id = 0;
};
struct allreduce_request {
  std::int32_t count = 0;
  float value = 0;
};

struct comm_holder {
  std::unique_ptr<collective::communicator> comm;
  collective_watch watch;  // declared after the communicator: it goes first
};

void make_reducer(role_builder& b, role_context&) {
  auto held = std::make_shared<comm_holder>();
  b.on<make_comm_request>([held](role_context& c, const make_comm_request& r) {
    collective::rank_group g;
    g.id = r.group_id;
    g.ranks = {0, 1};
    held->comm = collective::make_communicator(c.node().transport(), g, "ucx");
    held->watch = c.watch(*held->comm);
    return held->comm->name();
  });
  // Sums `value` over both ranks; blocks until the peer joins.
  b.on<allreduce_request>([held](role_context& c, const allreduce_request& r) {
    std::vector<float> v(static_cast<std::size_t>(r.count), r.value);
    c.set_activity("allreduce");
    collective::options o;
    o.timeout = 20000ms;  // a failed test must not leave the actor waiting for ever
    held->comm->allreduce(v.data(), v.size(), dtype::f32, o).wait();
    c.set_activity("idle");
    return v.front();
  });
  b.on_stop([held](role_context&) {
    held->watch.unwatch();
    held->comm.reset();
  });
}

const actor_state* find_actor(const job_snapshot& s, const std::string& name) {
  for (const auto& a : s.actors)
    if (a.name == name) return &a;
  return nullptr;
}

// Counts events; a test waits for a count on a condition variable.
class event_count {
 public:
  void operator++() {
    std::lock_guard<std::mutex> lock(mu_);
    ++n_;
    cv_.notify_all();
  }
  // Whether the count reached `want` (false only after `limit`, a hang guard).
  bool wait_for(int want, std::chrono::milliseconds limit) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, limit, [&] { return n_ >= want; });
  }
  int value() {
    std::lock_guard<std::mutex> lock(mu_);
    return n_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int n_ = 0;
};

// Polls the coordinator until `pred` holds for a snapshot (or the time is up); returns the last.
// A poll, not a synchronisation: the snapshot has no change event, and a predicate may need time
// to pass in the product (an operation's age); `limit` only guards against a hang.
job_snapshot snapshot_until(coordinator& c, const std::function<bool(const job_snapshot&)>& pred,
                            std::chrono::milliseconds limit = 15s) {
  const auto end = std::chrono::steady_clock::now() + limit;
  job_snapshot s = c.snapshot(2000ms);
  while (!pred(s) && std::chrono::steady_clock::now() < end) {
    std::this_thread::sleep_for(50ms);
    s = c.snapshot(2000ms);
  }
  return s;
}

}  // namespace

TEST_CASE("A describe answer keeps the last records and every unfinished one") {
  std::vector<flight_record> rs;
  // #1 running (stuck), #2 .. #12 done, #13 issued.
  rs.push_back(rec(1, "running", 100));
  for (std::uint64_t s = 2; s <= 12; ++s) rs.push_back(rec(s, "done", 100.0 * s, 100.0 * s + 50));
  rs.push_back(rec(13, "issued", 1300));
  auto ops = actors::detail::select_records("ucx:tp#3[0,1]", rs, 2'000'100.0, 4);
  CHECK(seqs(ops) == std::vector<std::uint64_t>{1, 10, 11, 12, 13});
  REQUIRE(ops.size() == 5);
  CHECK(ops[0].communicator == "ucx:tp#3[0,1]");
  CHECK(ops[0].op == "allreduce");
  CHECK(ops[0].dtype == "f32");
  CHECK(ops[0].state == "running");
  CHECK(ops[0].age_s == Approx(2.0));  // (2'000'100 - 100) us
  CHECK(ops[3].op == "send");
  CHECK(ops[3].peer == 1);
  CHECK(ops[3].count == 120);
  CHECK(ops[3].end_us == 1250);
  CHECK_FALSE(ops[4].finished());

  // Only unfinished ops at the end: the last finished one stays, to say where it stopped.
  std::vector<flight_record> tail;
  for (std::uint64_t s = 1; s <= 3; ++s) tail.push_back(rec(s, "done", s, s + 1));
  for (std::uint64_t s = 4; s <= 9; ++s) tail.push_back(rec(s, "issued", 10.0 * s));
  CHECK(seqs(actors::detail::select_records("c", tail, 1000, 4)) ==
        std::vector<std::uint64_t>{3, 4, 5, 6, 7, 8, 9});
  CHECK(actors::detail::select_records("c", {}, 0).empty());
}

TEST_CASE("A watch shows a communicator's records until its handle goes") {
  auto comms = collective::make_local_group(1);  // one rank: every op completes at once
  auto& comm = *comms[0];
  auto list = std::make_shared<actors::detail::watch_list>();
  std::vector<float> x(8, 1.0f);
  comm.allreduce(x.data(), x.size(), dtype::f32).wait();  // before the watch: still shown
  const auto watched_at = std::chrono::steady_clock::now();
  {
    collective_watch w(list, list->add(comm));
    CHECK(w.active());
    comm.barrier().wait();
    comm.broadcast(x.data(), 4, dtype::bf16).wait();
    auto ops = list->records();
    REQUIRE(ops.size() == 3);
    CHECK(ops[0].communicator == "local#0[0]");
    CHECK(ops[0].op == "allreduce");
    CHECK(ops[0].count == 8);
    CHECK(ops[1].op == "barrier");
    CHECK(ops[2].op == "broadcast");
    CHECK(ops[2].dtype == "bf16");
    CHECK(ops[2].peer == 0);
    for (const auto& o : ops) CHECK(o.state == "done");
    // Ages are lower bounds: the broadcast is younger than the watch.
    const double since_watch =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - watched_at).count();
    CHECK(ops[2].age_s <= since_watch);
    CHECK(ops[0].age_s >= ops[2].age_s);

    collective_watch moved = std::move(w);
    CHECK_FALSE(w.active());
    CHECK(moved.active());
    CHECK(list->records().size() == 3);
  }  // the handle goes: the list no longer touches the communicator
  CHECK(list->records().empty());

  collective_watch explicit_one(list, list->add(comm));
  CHECK(list->records().size() == 3);
  explicit_one.unwatch();
  CHECK_FALSE(explicit_one.active());
  CHECK(list->records().empty());
  explicit_one.unwatch();  // twice is harmless

  collective_watch outlives(list, list->add(comm));
  list.reset();  // the actor went first
  CHECK_FALSE(outlives.active());
  outlives.unwatch();
}

TEST_CASE("Collectives of watched communicators reach the coordinator's snapshot and endpoint",
          "[introspection]") {
  coordinator_options co;
  co.job = "flight-recorder-test";
  co.token = "flight-token";
  co.world_size = 2;
  co.register_job = false;
  co.heartbeat_timeout = 10000ms;
  co.log = [](const std::string&) {};
  coordinator coord(co);

  role_registry roles;
  roles.add("reducer", make_reducer);

  // Each rank: join, make a communicator of its own (group 7), watch it on the node, run a barrier
  // and an allreduce on it, then hold until the driver is done.
  std::promise<void> driver_done;
  std::shared_future<void> done_future = driver_done.get_future().share();
  std::vector<std::unique_ptr<node>> nodes(2);
  event_count ready;
  auto rank_main = [&](int rank) {
    node_options o;
    join_info j;
    j.coordinator = coord.endpoint();
    j.token = co.token;
    j.rank = rank;
    j.world_size = 2;
    j.local_rank = rank;
    j.net_device = "lo";
    j.source = "options";
    o.join = j;
    o.roles = &roles;
    o.join_timeout = 30000ms;
    o.caf_threads = 1;
    nodes[rank] = std::make_unique<node>(o);
    node& n = *nodes[rank];
    collective::rank_group g;
    g.id = 7;
    g.ranks = {0, 1};
    auto comm = collective::make_communicator(n.transport(), g, "ucx");
    auto watch = n.watch(*comm);
    comm->barrier().wait();
    float x = static_cast<float>(rank + 1);
    comm->allreduce(&x, 1, dtype::f32).wait();
    ++ready;
    done_future.wait();
    watch.unwatch();
    comm.reset();
    n.barrier("flight-done", 30000ms);
  };
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        rank_main(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
        ++ready;
      }
    });
  struct joiner {
    std::promise<void>& done;
    std::vector<std::thread>& threads;
    std::vector<std::unique_ptr<node>>& nodes;
    bool released = false;
    void release() {
      if (!released) done.set_value();
      released = true;
    }
    ~joiner() {
      release();
      for (auto& t : threads) t.join();
      for (auto& n : nodes)
        if (n) n->shutdown();
    }
  } join_all{driver_done, threads, nodes};

  REQUIRE(ready.wait_for(2, 120s));  // both ranks ready, or failed
  INFO("rank 0: " << errors[0] << " rank 1: " << errors[1]);
  REQUIRE(ready.value() == 2);
  REQUIRE(errors[0].empty());
  REQUIRE(errors[1].empty());

  // The nodes' own communicator: barrier #1 and allreduce #2, both done.
  {
    auto s = coord.snapshot(2000ms);
    for (const char* name : {"node@0", "node@1"}) {
      INFO(name);
      const actor_state* a = find_actor(s, name);
      REQUIRE(a != nullptr);
      REQUIRE(a->collectives.size() == 2);
      CHECK(a->collectives[0].communicator == "ucx#7[0,1]");
      CHECK(a->collectives[0].op == "barrier");
      CHECK(a->collectives[0].seq == 1);
      CHECK(a->collectives[1].op == "allreduce");
      CHECK(a->collectives[1].seq == 2);
      CHECK(a->collectives[1].count == 1);
      CHECK(a->collectives[1].state == "done");
    }
  }

  job j(*nodes[0]);
  auto reducers = j.spawn_on_all("reducer");
  REQUIRE(reducers.size() == 2);
  auto names = j.ask_all<std::string>(reducers, make_comm_request{3}, 10s);
  CHECK(names == std::vector<std::string>{"ucx#3[0,1]", "ucx#3[0,1]"});
  for (int k = 1; k <= 3; ++k) {
    auto sums = j.ask_all<float>(reducers, allreduce_request{256, float(k)}, 10s);
    CHECK(sums == std::vector<float>{2.0f * k, 2.0f * k});
  }

  // Three allreduces, numbered 1 to 3 on both ranks, as JSON from the HTTP endpoint.
  auto endpoint = parse_endpoint(coord.http_endpoint());
  REQUIRE(endpoint.has_value());
  const auto [host, port] = *endpoint;
  {
    auto snap = fetch_snapshot(host, port, 5000ms);
    REQUIRE(snap.has_value());
    for (const char* name : {"reducer@0", "reducer@1"}) {
      INFO(name);
      const actor_state* a = find_actor(*snap, name);
      REQUIRE(a != nullptr);
      REQUIRE(a->collectives.size() == 3);
      for (std::size_t i = 0; i < 3; ++i) {
        CHECK(a->collectives[i].communicator == "ucx#3[0,1]");
        CHECK(a->collectives[i].seq == i + 1);
        CHECK(a->collectives[i].op == "allreduce");
        CHECK(a->collectives[i].dtype == "f32");
        CHECK(a->collectives[i].count == 256);
        CHECK(a->collectives[i].state == "done");
        CHECK(a->collectives[i].end_us >= a->collectives[i].start_us);
      }
    }
  }

  // Rank 0 enters allreduce #4 alone: its actor hangs there and the snapshot says so.
  const auto hang_started = std::chrono::steady_clock::now();
  auto stuck = std::async(std::launch::async, [&] {
    job j0(*nodes[0]);
    return j0.ask<float>(reducers[0], allreduce_request{256, 10.0f}, 30s);
  });
  auto hung = snapshot_until(coord, [](const job_snapshot& s) {
    const actor_state* a = find_actor(s, "reducer@0");
    return a && !a->collectives.empty() && a->collectives.back().seq == 4 &&
           a->collectives.back().age_s > 0.3;
  });
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - hang_started).count();
  {
    const actor_state* a = find_actor(hung, "reducer@0");
    REQUIRE(a != nullptr);
    REQUIRE(!a->collectives.empty());
    const collective_op& op = a->collectives.back();
    CHECK(op.seq == 4);
    CHECK(op.op == "allreduce");
    CHECK_FALSE(op.finished());
    CHECK((op.state == "running" || op.state == "issued"));
    CHECK(op.age_s > 0.3);
    CHECK(op.age_s <= waited + 0.01);
    const actor_state* b = find_actor(hung, "reducer@1");
    REQUIRE(b != nullptr);
    REQUIRE(!b->collectives.empty());
    CHECK(b->collectives.back().seq == 3);  // rank 1 never issued #4
    CHECK(b->collectives.back().finished());

    std::string table = render_table(hung, 0);
    INFO(table);
    std::string row;
    for (std::size_t at = table.find("reducer@0"); at != std::string::npos;) {
      row = table.substr(at, table.find('\n', at) - at);
      break;
    }
    CHECK(row.find("allreduce #4 " + op.state) != std::string::npos);
    CHECK(row.find("on ucx#3[0,1]") != std::string::npos);

    exposition e = parse_exposition(to_prometheus(hung));
    REQUIRE(e.error.empty());
    const std::map<std::string, std::string> l0 = {{"actor", "reducer@0"},
                                                   {"communicator", "ucx#3[0,1]"}};
    const std::map<std::string, std::string> l1 = {{"actor", "reducer@1"},
                                                   {"communicator", "ucx#3[0,1]"}};
    CHECK(e.value("troupe_collective_last_seq", l0) == 4);
    CHECK(e.value("troupe_collective_last_completed_seq", l0) == 3);
    CHECK(e.value("troupe_collective_unfinished", l0) == 1);
    CHECK(e.value("troupe_collective_oldest_unfinished_seconds", l0) > 0.3);
    CHECK(e.value("troupe_collective_last_seq", l1) == 3);
    CHECK(e.value("troupe_collective_unfinished", l1) == 0);
  }
  // The endpoint's Prometheus text says the same.
  {
    auto text = http_get(host, port, "/metrics", 5000ms);
    REQUIRE(text.has_value());
    exposition e = parse_exposition(*text);
    REQUIRE(e.error.empty());
    CHECK(e.value("troupe_collective_unfinished",
                  {{"actor", "reducer@0"}, {"communicator", "ucx#3[0,1]"}}) == 1);
  }

  // Rank 1 joins at last: both finish #4 and the record says done.
  CHECK(j.ask<float>(reducers[1], allreduce_request{256, 5.0f}, 10s) == 15.0f);
  REQUIRE(stuck.wait_for(10s) == std::future_status::ready);
  CHECK(stuck.get() == 15.0f);
  auto after = snapshot_until(coord, [](const job_snapshot& s) {
    const actor_state* a = find_actor(s, "reducer@0");
    return a && !a->collectives.empty() && a->collectives.back().finished();
  });
  const actor_state* a = find_actor(after, "reducer@0");
  REQUIRE(a != nullptr);
  REQUIRE(!a->collectives.empty());
  CHECK(a->collectives.back().seq == 4);
  CHECK(a->collectives.back().state == "done");

  // Unwatched communicators leave the describe answer.
  join_all.release();
  auto quiet = snapshot_until(coord, [](const job_snapshot& s) {
    const actor_state* n0 = find_actor(s, "node@0");
    return n0 && n0->collectives.empty();
  });
  const actor_state* n0 = find_actor(quiet, "node@0");
  REQUIRE(n0 != nullptr);
  CHECK(n0->collectives.empty());
  j.stop(reducers[0]);
  j.stop(reducers[1]);
}
