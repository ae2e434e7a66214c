// The coordinator actor: admission by token, world formation (join, addresses, ready), heartbeats,
// loss detection, barriers and the job snapshot; and the coordinator class around it.
#include "actors/coordinator.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <ctime>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <sstream>

#include "actors/bootstrap.hpp"
#include "actors/caf_system.hpp"
#include "actors/introspection/http_server.hpp"
#include "actors/introspection/job_registry.hpp"
#include "memory/error.hpp"

namespace troupe::actors {
namespace {

using clock = std::chrono::steady_clock;

double seconds_since(clock::time_point t) {
  return std::chrono::duration<double>(clock::now() - t).count();
}

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f s", s);
  return buf;
}

// What the coordinator class reads without messaging the actor.
struct shared_status {
  std::mutex mu;
  std::condition_variable cv;
  int joined = 0;
  bool started = false;
  bool finished = false;
  std::vector<int> alive_pids;  // by rank: the pid of the member in good standing (0: none)
};

struct member_rec {
  enum status_t { absent, joining, alive, lost, left } status = absent;
  msg::member_info info;
  caf::node_id nid;
  std::string reason;
  clock::time_point last_seen;
  caf::typed_response_promise<msg::join_reply> join_rp;
  std::vector<char> ucx;
  bool address_in = false;
  caf::typed_response_promise<msg::address_reply> address_rp;
  bool ready_in = false;
  caf::typed_response_promise<msg::ready_reply> ready_rp;
  // A new process taking the place of this lost rank in a running job: the survivors that still
  // have to connect to it (joined_ack) before it starts.
  bool rejoining = false;
  std::set<int> acks_missing;
};

struct barrier_rec {
  std::map<int, caf::typed_response_promise<msg::barrier_reply>> waiting;
};

struct coordinator_state {
  coordinator_options opts;
  std::shared_ptr<shared_status> shared;
  std::vector<member_rec> members;
  int joined = 0, addresses = 0, ready = 0;
  bool started = false;
  std::string forming_failed;  // why the world could not form
  std::uint64_t epoch = 0;
  std::map<std::string, barrier_rec> barriers;
  std::set<caf::node_id> warned;
  std::deque<membership_event> events;                // the snapshot's membership log, the last 200
  std::map<std::string, std::uint64_t> event_counts;  // every event, by kind
  clock::time_point born = clock::now();
  clock::time_point last_waiting_log = clock::now();
  std::uint64_t msgs_in = 0, msgs_out = 0;
  std::int64_t interval_ms = 750;
  static inline const char* name = "troupe_coordinator";
};

using coord_actor = caf::stateful_actor<coordinator_state>;

void log(coord_actor* self, const std::string& line) {
  self->state.opts.log(line);
}

// Keeps a membership change for the snapshot (the dashboard's event log); note() logs it too.
void remember(coord_actor* self, int rank, const char* kind, const std::string& line) {
  auto& st = self->state;
  st.events.push_back({seconds_since(st.born), st.epoch, rank, kind, line});
  while (st.events.size() > 200) st.events.pop_front();
  ++st.event_counts[kind];
}
void note(coord_actor* self, int rank, const char* kind, const std::string& line) {
  log(self, line);
  remember(self, rank, kind, line);
}

void publish_status(coord_actor* self) {
  auto& st = self->state;
  bool finished = st.started;
  for (const auto& m : st.members)
    if (m.status == member_rec::alive || m.status == member_rec::joining) finished = false;
  if (!st.forming_failed.empty()) finished = true;
  std::lock_guard<std::mutex> lock(st.shared->mu);
  st.shared->alive_pids.assign(st.members.size(), 0);
  for (std::size_t r = 0; r < st.members.size(); ++r)
    if (st.members[r].status == member_rec::alive || st.members[r].status == member_rec::joining)
      st.shared->alive_pids[r] = st.members[r].info.pid;
  st.shared->joined = st.joined;
  st.shared->started = st.started;
  st.shared->finished = finished;
  st.shared->cv.notify_all();
}

// The rank `rank` sent the current message from its own process, and is a member in good standing.
bool from_member(coord_actor* self, int rank, const char* what) {
  auto& st = self->state;
  const auto& sender = self->current_sender();
  const bool known_rank = rank >= 0 && rank < static_cast<int>(st.members.size());
  if (sender && known_rank && st.members[rank].status != member_rec::absent &&
      sender->node() == st.members[rank].nid) {
    const auto s = st.members[rank].status;
    if (s == member_rec::alive || s == member_rec::joining) return true;
    return false;  // a lost or departed member: its messages no longer count
  }
  const caf::node_id who = sender ? sender->node() : caf::node_id{};
  if (st.warned.insert(who).second)
    log(self, std::string("ignoring ") + what + " claiming rank " + std::to_string(rank) +
                  " from " + (sender ? caf::to_string(who) : std::string("an anonymous sender")) +
                  ": not a member of the job (messages from there are ignored from now on)");
  return false;
}

void fail_forming(coord_actor* self, const std::string& why) {
  auto& st = self->state;
  if (st.started || !st.forming_failed.empty()) return;
  st.forming_failed = why;
  log(self, "the job cannot start: " + why);
  for (auto& m : st.members) {
    if (m.join_rp.pending()) {
      msg::join_reply r;
      r.accepted = false;
      r.reason = "the job cannot start: " + why;
      m.join_rp.deliver(std::move(r));
    }
    if (m.address_rp.pending()) m.address_rp.deliver(msg::address_reply{false, why, {}});
    if (m.ready_rp.pending()) m.ready_rp.deliver(msg::ready_reply{false, why, 0});
  }
}

void fail_barriers(coord_actor* self, const std::string& why) {
  for (auto& [name, b] : self->state.barriers)
    for (auto& [rank, rp] : b.waiting)
      rp.deliver(msg::barrier_reply{false, "barrier \"" + name + "\" failed: " + why});
  self->state.barriers.clear();
}

// Releases every barrier that all members in good standing have reached.
void check_barriers(coord_actor* self) {
  auto& st = self->state;
  for (auto it = st.barriers.begin(); it != st.barriers.end();) {
    bool complete = true;
    for (std::size_t r = 0; r < st.members.size(); ++r)
      if (st.members[r].status == member_rec::alive && !it->second.waiting.count(int(r)))
        complete = false;
    if (complete) {
      for (auto& [rank, rp] : it->second.waiting) rp.deliver(msg::barrier_reply{true, {}});
      it = st.barriers.erase(it);
    } else {
      ++it;
    }
  }
}

void broadcast(coord_actor* self, const caf::message& m, int also = -1) {
  auto& st = self->state;
  for (std::size_t r = 0; r < st.members.size(); ++r) {
    const auto& mr = st.members[r];
    if (mr.status == member_rec::alive || mr.status == member_rec::joining ||
        static_cast<int>(r) == also) {
      if (!mr.info.node) continue;
      self->send(mr.info.node, m);
      ++st.msgs_out;
    }
  }
}

std::vector<std::string> member_status(const coordinator_state& st) {
  std::vector<std::string> out;
  for (const auto& m : st.members)
    out.push_back(m.status == member_rec::lost   ? "lost: " + m.reason
                  : m.status == member_rec::left ? std::string("left the job")
                                                 : std::string());
  return out;
}

// A rejoining rank starts once it asked to and every survivor has connected to it.
void complete_rejoin(coord_actor* self, int rank) {
  auto& st = self->state;
  auto& m = st.members[rank];
  if (!m.rejoining || !m.ready_in || !m.acks_missing.empty()) return;
  m.rejoining = false;
  m.status = member_rec::alive;
  m.last_seen = clock::now();
  m.ready_rp.deliver(msg::ready_reply{true, {}, st.epoch});
  note(self, rank, "rejoined",
       "rank " + std::to_string(rank) + " (host " + m.info.host + ", pid " +
           std::to_string(m.info.pid) + ") rejoined; membership epoch " + std::to_string(st.epoch));
}

void declare_lost(coord_actor* self, int rank, const std::string& reason) {
  auto& st = self->state;
  auto& m = st.members[rank];
  if (m.status != member_rec::alive && m.status != member_rec::joining) return;
  m.status = member_rec::lost;
  m.reason = reason;
  ++st.epoch;
  note(self, rank, "lost",
       "rank " + std::to_string(rank) + " (host " + m.info.host + ", pid " +
           std::to_string(m.info.pid) + ") lost: " + reason + "; membership epoch " +
           std::to_string(st.epoch));
  if (m.info.node) self->demonitor(m.info.node);
  // Every survivor, and the lost rank itself in case it is only stopped and comes back.
  broadcast(self, caf::make_message(msg::member_lost{rank, reason, st.epoch}), rank);
  const std::string why = "rank " + std::to_string(rank) + " lost: " + reason;
  fail_barriers(self, why);
  if (!st.started) fail_forming(self, why + " while the job was starting");
  if (m.rejoining) {
    m.rejoining = false;
    if (m.address_rp.pending()) m.address_rp.deliver(msg::address_reply{false, why, {}});
    if (m.ready_rp.pending()) m.ready_rp.deliver(msg::ready_reply{false, why, 0});
  }
  // A survivor that is gone no longer needs to connect to a rejoining rank.
  for (std::size_t r = 0; r < st.members.size(); ++r)
    if (st.members[r].rejoining && st.members[r].acks_missing.erase(rank))
      complete_rejoin(self, static_cast<int>(r));
  publish_status(self);
}

actor_state own_state(coord_actor* self) {
  auto& st = self->state;
  actor_state a;
  a.name = "coordinator";
  a.role = "coordinator";
  a.rank = -1;
  a.activity = st.started ? "watching " + std::to_string(st.members.size()) + " ranks"
                          : "forming: " + std::to_string(st.joined) + " of " +
                                std::to_string(st.members.size()) + " joined";
  a.mailbox_depth = queued_messages(self);
  a.messages_received = st.msgs_in;
  a.messages_sent = st.msgs_out;
  a.uptime_s = seconds_since(st.born);
  a.metrics["epoch"] = static_cast<double>(st.epoch);
  return a;
}

std::string status_text(const member_rec& m) {
  switch (m.status) {
    case member_rec::joining:
      return "joining";
    case member_rec::alive:
      return "alive";
    case member_rec::lost:
      return "lost: " + m.reason;
    case member_rec::left:
      return "left";
    default:
      return "absent";
  }
}

caf::behavior coordinator_actor(coord_actor* self, coordinator_options opts,
                                std::shared_ptr<shared_status> shared) {
  auto& st = self->state;
  st.opts = std::move(opts);
  st.shared = std::move(shared);
  st.members.resize(static_cast<std::size_t>(st.opts.world_size));
  st.interval_ms = std::max<std::int64_t>(10, st.opts.heartbeat_timeout.count() / 4);
  // Unknown messages (a peer of another version, or not of this job) are dropped quietly.
  self->set_default_handler(caf::drop);
  self->set_down_handler([self](const caf::down_msg& dm) {
    auto& st = self->state;
    for (std::size_t r = 0; r < st.members.size(); ++r) {
      auto& m = st.members[r];
      if (m.info.node && m.info.node.address() == dm.source &&
          (m.status == member_rec::alive || m.status == member_rec::joining))
        declare_lost(
            self, static_cast<int>(r),
            "connection lost (process exited or was killed: " + caf::to_string(dm.reason) + ")");
    }
  });
  self->delayed_send(self, std::chrono::milliseconds(st.interval_ms), msg::tick_atom::value);
  return {
      [self](msg::join_request& req) -> caf::result<msg::join_reply> {
        auto& st = self->state;
        ++st.msgs_in;
        const bool joiner = req.rank == -1;
        std::string who = (joiner ? std::string("a joiner") : "rank " + std::to_string(req.rank)) +
                          " (host " + req.host + ", pid " + std::to_string(req.pid) + ")";
        auto refuse = [&](const std::string& why) {
          note(self, -1, "refused", "refused " + who + ": " + why);
          msg::join_reply r;
          r.accepted = false;
          r.reason = why;
          return r;
        };
        if (req.token.empty())
          return refuse(
              "no job token (set TROUPE_TOKEN or TROUPE_TOKEN_FILE, or run under troupe "
              "launch)");
        if (!tokens_equal(req.token, st.opts.token)) return refuse("wrong job token");
        if (!req.node) return refuse("no node actor in the join request");
        const int world = static_cast<int>(st.members.size());
        if (req.rank == -1) {
          // A joiner (troupe launch --join): the place of the lowest lost or departed rank of a
          // running job.
          if (!st.started)
            return refuse(
                "a joiner (troupe launch --join) takes a lost rank's place in a running "
                "job, and this one has not started yet");
          for (int r = 0; r < world && req.rank < 0; ++r)
            if (st.members[r].status == member_rec::lost ||
                st.members[r].status == member_rec::left)
              req.rank = r;
          if (req.rank < 0)
            return refuse("no place for a joiner (troupe launch --join): none of the job's " +
                          std::to_string(world) + " ranks is lost or has left");
          who += " as rank " + std::to_string(req.rank);
        }
        if (req.rank < 0 || req.rank >= world)
          return refuse("rank " + std::to_string(req.rank) + " is outside the job's world of " +
                        std::to_string(world) + " ranks");
        if (req.world_size > 0 && req.world_size != world)
          return refuse("it expects a world of " + std::to_string(req.world_size) +
                        " ranks, the job has " + std::to_string(world));
        if (!st.forming_failed.empty())
          return refuse("the job could not start: " + st.forming_failed);
        auto& m = st.members[req.rank];
        if (st.started) {
          // A new process may take the place of a lost (or departed) rank.
          if (m.status != member_rec::lost && m.status != member_rec::left)
            return refuse("the job has already started and rank " + std::to_string(req.rank) +
                          " is in it (host " + m.info.host + ", pid " + std::to_string(m.info.pid) +
                          ")");
          m.status = member_rec::joining;
          m.rejoining = true;
          m.address_in = m.ready_in = false;
          m.acks_missing.clear();
          m.info = msg::member_info{req.rank,          req.host,          req.pid,
                                    req.endpoint_host, req.endpoint_port, req.node};
          m.nid = req.node.node();
          m.last_seen = clock::now();
          self->monitor(req.node);
          note(self, req.rank, "rejoining", who + " rejoins the running job");
          msg::join_reply r;
          r.accepted = true;
          r.job = st.opts.job;
          r.world_size = world;
          r.heartbeat_interval_ms = st.interval_ms;
          r.heartbeat_timeout_ms = st.opts.heartbeat_timeout.count();
          for (const auto& mm : st.members) r.members.push_back(mm.info);
          r.member_status = member_status(st);
          r.member_status[req.rank].clear();
          r.rank = req.rank;
          publish_status(self);
          return r;
        }
        if (m.status != member_rec::absent)
          return refuse("rank " + std::to_string(req.rank) + " already joined from host " +
                        m.info.host + ", pid " + std::to_string(m.info.pid));
        m.status = member_rec::joining;
        m.info = msg::member_info{req.rank,          req.host,          req.pid,
                                  req.endpoint_host, req.endpoint_port, req.node};
        m.nid = req.node.node();
        m.last_seen = clock::now();
        self->monitor(req.node);
        ++st.joined;
        note(self, req.rank, "joined",
             who + " joined (" + std::to_string(st.joined) + " of " + std::to_string(world) + ")");
        m.join_rp = self->make_response_promise<msg::join_reply>();
        auto rp = m.join_rp;
        if (st.joined == world) {
          msg::join_reply r;
          r.accepted = true;
          r.job = st.opts.job;
          r.world_size = world;
          r.heartbeat_interval_ms = st.interval_ms;
          r.heartbeat_timeout_ms = st.opts.heartbeat_timeout.count();
          for (const auto& mm : st.members) r.members.push_back(mm.info);
          for (std::size_t k = 0; k < st.members.size(); ++k) {
            r.rank = static_cast<std::int32_t>(k);
            st.members[k].join_rp.deliver(r);
          }
        }
        publish_status(self);
        return rp;
      },
      [self](msg::address_request& req) -> caf::result<msg::address_reply> {
        auto& st = self->state;
        ++st.msgs_in;
        if (!from_member(self, req.rank, "an address")) return caf::sec::request_receiver_down;
        if (!st.forming_failed.empty()) return msg::address_reply{false, st.forming_failed, {}};
        auto& m = st.members[req.rank];
        if (m.rejoining) {
          m.address_in = true;
          m.ucx = std::move(req.ucx_address);
          msg::address_reply r{true, {}, {}};
          for (const auto& mm : st.members) r.addresses.push_back(mm.ucx);
          // Every survivor connects to the new process, then acknowledges.
          ++st.epoch;
          for (std::size_t p = 0; p < st.members.size(); ++p)
            if (st.members[p].status == member_rec::alive) m.acks_missing.insert(int(p));
          broadcast(self, caf::make_message(msg::member_joined{req.rank, m.info, m.ucx, st.epoch}));
          return r;
        }
        if (!m.address_in) ++st.addresses;
        m.address_in = true;
        m.ucx = std::move(req.ucx_address);
        m.address_rp = self->make_response_promise<msg::address_reply>();
        auto rp = m.address_rp;
        if (st.addresses == static_cast<int>(st.members.size())) {
          msg::address_reply r{true, {}, {}};
          for (const auto& mm : st.members) r.addresses.push_back(mm.ucx);
          for (auto& mm : st.members) mm.address_rp.deliver(r);
        }
        return rp;
      },
      [self](msg::ready_request& req) -> caf::result<msg::ready_reply> {
        auto& st = self->state;
        ++st.msgs_in;
        if (!from_member(self, req.rank, "a ready message")) return caf::sec::request_receiver_down;
        if (!st.forming_failed.empty()) return msg::ready_reply{false, st.forming_failed, 0};
        auto& m = st.members[req.rank];
        if (m.rejoining) {
          m.ready_in = true;
          m.ready_rp = self->make_response_promise<msg::ready_reply>();
          auto rp = m.ready_rp;
          complete_rejoin(self, req.rank);
          publish_status(self);
          return rp;
        }
        if (!m.ready_in) ++st.ready;
        m.ready_in = true;
        m.ready_rp = self->make_response_promise<msg::ready_reply>();
        auto rp = m.ready_rp;
        if (st.ready == static_cast<int>(st.members.size())) {
          st.started = true;
          st.epoch = 1;
          for (auto& mm : st.members) {
            if (mm.status == member_rec::joining) mm.status = member_rec::alive;
            mm.last_seen = clock::now();
            mm.ready_rp.deliver(msg::ready_reply{true, {}, st.epoch});
          }
          note(self, -1, "started",
               "all " + std::to_string(st.members.size()) + " ranks joined and connected");
          publish_status(self);
        }
        return rp;
      },
      [self](msg::heartbeat& hb) {
        auto& st = self->state;
        ++st.msgs_in;
        if (!from_member(self, hb.rank, "a heartbeat")) return;
        st.members[hb.rank].last_seen = clock::now();
      },
      [self](msg::tick_atom) {
        auto& st = self->state;
        const auto now = clock::now();
        for (std::size_t r = 0; r < st.members.size(); ++r) {
          auto& m = st.members[r];
          // Heartbeats count from the start; while the world forms (ranks may start minutes
          // apart under a batch system) a dead joiner is caught by its connection instead.
          if (m.status != member_rec::alive) continue;
          const double silent = std::chrono::duration<double>(now - m.last_seen).count();
          if (silent * 1000.0 > static_cast<double>(st.opts.heartbeat_timeout.count()))
            declare_lost(self, static_cast<int>(r),
                         "no heartbeat for " + fmt_seconds(silent) + " (timeout " +
                             fmt_seconds(st.opts.heartbeat_timeout.count() / 1000.0) + ")");
        }
        broadcast(self, caf::make_message(msg::coordinator_beat{st.epoch}));
        if (!st.started && st.forming_failed.empty() &&
            now - st.last_waiting_log > std::chrono::seconds(10)) {
          st.last_waiting_log = now;
          std::string missing;
          for (std::size_t r = 0; r < st.members.size(); ++r)
            if (st.members[r].status == member_rec::absent)
              missing += (missing.empty() ? "" : ", ") + std::to_string(r);
          if (!missing.empty()) log(self, "still waiting for ranks " + missing + " to join");
        }
        self->delayed_send(self, std::chrono::milliseconds(st.interval_ms), msg::tick_atom::value);
      },
      [self](msg::joined_ack& ack) {
        auto& st = self->state;
        ++st.msgs_in;
        if (!from_member(self, ack.rank, "a joined_ack")) return;
        if (ack.joined < 0 || ack.joined >= static_cast<std::int32_t>(st.members.size())) return;
        auto& m = st.members[ack.joined];
        if (m.rejoining && m.acks_missing.erase(ack.rank)) complete_rejoin(self, ack.joined);
        publish_status(self);
      },
      [self](msg::exited_atom, std::int32_t rank, std::int32_t pid, std::string& how) {
        auto& st = self->state;
        const auto& s = self->current_sender();
        if (!s || s->node() != self->node()) return;
        if (rank < 0 || rank >= static_cast<std::int32_t>(st.members.size())) return;
        auto& m = st.members[rank];
        if (m.status != member_rec::absent && m.info.pid != pid) return;  // another incarnation
        if (m.status == member_rec::alive || m.status == member_rec::joining)
          declare_lost(self, rank, "its process " + how);
        else if (m.status == member_rec::absent && !st.started)
          fail_forming(self, "rank " + std::to_string(rank) + " " + how + " before joining");
        publish_status(self);
      },
      [self](msg::job_event& e) -> msg::barrier_reply {
        auto& st = self->state;
        ++st.msgs_in;
        if (!from_member(self, e.rank, "an event")) return {false, "not a member"};
        const auto& kinds = msg::note_event_kinds;
        if (std::find(kinds.begin(), kinds.end(), e.kind) == kinds.end())
          return {false, "event kind '" + e.kind + "' is not one a member may note"};
        if (e.detail.size() > 4096) e.detail.resize(4096);
        remember(self, e.rank, e.kind.c_str(), e.detail);
        return {true, {}};
      },
      [self](msg::leave_request& req) -> msg::barrier_reply {
        auto& st = self->state;
        ++st.msgs_in;
        if (!from_member(self, req.rank, "a leave request")) return {false, "not a member"};
        auto& m = st.members[req.rank];
        m.status = member_rec::left;
        if (m.info.node) self->demonitor(m.info.node);
        ++st.epoch;
        remember(self, req.rank, "left",
                 "rank " + std::to_string(req.rank) + " left the job; membership epoch " +
                     std::to_string(st.epoch));
        broadcast(self, caf::make_message(msg::member_left{req.rank, st.epoch}));
        if (!st.started)
          fail_forming(self,
                       "rank " + std::to_string(req.rank) + " left while the job was starting");
        check_barriers(self);
        publish_status(self);
        return {true, {}};
      },
      [self](msg::barrier_request& req) -> caf::result<msg::barrier_reply> {
        auto& st = self->state;
        ++st.msgs_in;
        if (!from_member(self, req.rank, "a barrier request"))
          return msg::barrier_reply{false, "not a member of the job"};
        auto rp = self->make_response_promise<msg::barrier_reply>();
        st.barriers[req.name].waiting[req.rank] = rp;
        check_barriers(self);
        return rp;
      },
      [self](msg::describe_atom) -> caf::result<actor_state> {
        const auto& s = self->current_sender();
        bool member = s && s->node() == self->node();
        for (const auto& m : self->state.members)
          member = member || (s && m.status != member_rec::absent && s->node() == m.nid);
        if (!member) return caf::sec::request_receiver_down;
        return own_state(self);
      },
      [self](msg::snapshot_atom, std::int64_t timeout_ms) -> caf::result<job_snapshot> {
        auto& st = self->state;
        const auto& sender = self->current_sender();
        if (!sender || sender->node() != self->node()) return caf::sec::request_receiver_down;
        struct gather {
          job_snapshot snap;
          int pending = 0;
          caf::typed_response_promise<job_snapshot> rp;
        };
        auto g = std::make_shared<gather>();
        g->rp = self->make_response_promise<job_snapshot>();
        g->snap.job = st.opts.job;
        g->snap.world_size = static_cast<int>(st.members.size());
        g->snap.uptime_s = seconds_since(st.born);
        const auto now = clock::now();
        for (std::size_t r = 0; r < st.members.size(); ++r) {
          const auto& m = st.members[r];
          member_state ms;
          ms.rank = static_cast<int>(r);
          ms.host = m.info.host;
          ms.pid = m.info.pid;
          ms.status = status_text(m);
          ms.last_heartbeat_age_s = m.status == member_rec::absent
                                        ? 0.0
                                        : std::chrono::duration<double>(now - m.last_seen).count();
          g->snap.members.push_back(ms);
        }
        g->snap.actors.push_back(own_state(self));
        g->snap.events.assign(st.events.begin(), st.events.end());
        g->snap.event_counts = st.event_counts;
        auto done = [g] {
          if (--g->pending == 0) g->rp.deliver(std::move(g->snap));
        };
        g->pending = 1;  // released below, after every request is out
        for (std::size_t r = 0; r < st.members.size(); ++r) {
          const auto& m = st.members[r];
          if (m.status != member_rec::alive && m.status != member_rec::joining) continue;
          ++g->pending;
          const int rank = static_cast<int>(r);
          self->request(m.info.node, std::chrono::milliseconds(timeout_ms),
                        msg::describe_atom::value)
              .then(
                  [g, done](std::vector<actor_state>& states) {
                    for (auto& a : states) g->snap.actors.push_back(std::move(a));
                    done();
                  },
                  [self, g, done, rank](caf::error& err) {
                    actor_state a;
                    a.name = "node@" + std::to_string(rank);
                    a.role = "node";
                    a.rank = rank;
                    a.activity = "no answer: " + self->system().render(err);
                    g->snap.actors.push_back(std::move(a));
                    done();
                  });
        }
        done();
        return g->rp;
      },
  };
}

}  // namespace

struct coordinator::impl {
  coordinator_options opts;
  std::unique_ptr<caf::actor_system_config> cfg;
  std::unique_ptr<caf::actor_system> sys;
  caf::actor actor;
  std::shared_ptr<shared_status> shared = std::make_shared<shared_status>();
  std::uint16_t port = 0;
  std::unique_ptr<http_server> http;
  bool registered = false;

  job_snapshot snapshot(std::chrono::milliseconds timeout) {
    caf::scoped_actor self{*sys};
    job_snapshot out;
    std::string failure;
    self->request(actor, timeout + std::chrono::milliseconds(1000), msg::snapshot_atom::value,
                  static_cast<std::int64_t>(timeout.count()))
        .receive([&](job_snapshot& s) { out = std::move(s); },
                 [&](caf::error& e) { failure = sys->render(e); });
    if (!failure.empty()) TROUPE_FAIL("job ", opts.job, ": snapshot failed: ", failure);
    return out;
  }
};

coordinator::coordinator(coordinator_options options) : impl_(std::make_unique<impl>()) {
  auto& o = options;
  TROUPE_CHECK(o.world_size > 0, "coordinator: the world size must be positive, not ",
               o.world_size);
  TROUPE_CHECK(!o.token.empty(), "coordinator: the job token is empty");
  TROUPE_CHECK(o.heartbeat_timeout.count() >= 40, "coordinator: heartbeat timeout ",
               o.heartbeat_timeout.count(), " ms is below 40 ms");
  if (o.job.empty()) o.job = "job-" + std::to_string(::getpid());
  if (!o.log)
    o.log = [](const std::string& line) {
      std::fprintf(stderr, "troupe coordinator: %s\n", line.c_str());
      std::fflush(stderr);
    };
  impl_->opts = o;
  impl_->cfg = detail::make_caf_config(0, &o.tls);
  impl_->sys = std::make_unique<caf::actor_system>(*impl_->cfg);
  impl_->actor = impl_->sys->spawn(coordinator_actor, o, impl_->shared);
  auto port = detail::publish_actor(*impl_->sys, impl_->actor, o.port, o.bind.c_str());
  if (!port) {
    const std::string why = impl_->sys->render(port.error());
    caf::anon_send_exit(impl_->actor, caf::exit_reason::user_shutdown);
    impl_->actor = nullptr;
    TROUPE_FAIL("coordinator: cannot listen on ", o.bind, ":", o.port, ": ", why);
  }
  impl_->port = *port;
  if (o.serve_http) {
    impl* self = impl_.get();
    http_server_options ho;
    ho.bind = o.http_bind;
    ho.port = o.http_port;
    ho.allowed_hosts = o.http_allowed_hosts;
    impl_->http = std::make_unique<http_server>(
        [self] { return self->snapshot(std::chrono::milliseconds(1000)); }, ho);
    if (o.register_job) {
      job_entry e;
      e.job = o.job;
      e.endpoint = impl_->http->endpoint();
      e.pid = ::getpid();
      e.started = static_cast<double>(std::time(nullptr));
      register_job(e);
      impl_->registered = true;
    }
  }
}

coordinator::~coordinator() {
  if (!impl_) return;
  if (impl_->registered) {
    try {
      unregister_job(impl_->opts.job);
    } catch (...) {
    }
  }
  impl_->http.reset();
  if (impl_->actor) caf::anon_send_exit(impl_->actor, caf::exit_reason::user_shutdown);
  impl_->actor = nullptr;
  impl_->sys.reset();
}

std::uint16_t coordinator::port() const {
  return impl_->port;
}
std::string coordinator::endpoint() const {
  return impl_->opts.bind + ":" + std::to_string(impl_->port);
}
std::string coordinator::http_endpoint() const {
  return impl_->http ? impl_->http->endpoint() : std::string();
}
const std::string& coordinator::job() const {
  return impl_->opts.job;
}

int coordinator::joined() const {
  std::lock_guard<std::mutex> lock(impl_->shared->mu);
  return impl_->shared->joined;
}
bool coordinator::finished() const {
  std::lock_guard<std::mutex> lock(impl_->shared->mu);
  return impl_->shared->finished;
}
bool coordinator::wait_finished(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(impl_->shared->mu);
  return impl_->shared->cv.wait_for(lock, timeout, [&] { return impl_->shared->finished; });
}

job_snapshot coordinator::snapshot(std::chrono::milliseconds timeout) {
  return impl_->snapshot(timeout);
}

bool coordinator::taken_over(int rank, int pid) const {
  std::lock_guard<std::mutex> lock(impl_->shared->mu);
  const auto& p = impl_->shared->alive_pids;
  return rank >= 0 && rank < static_cast<int>(p.size()) && p[static_cast<std::size_t>(rank)] != 0 &&
         p[static_cast<std::size_t>(rank)] != pid;
}

void coordinator::process_ended(int rank, int pid, const std::string& how) {
  caf::scoped_actor self{*impl_->sys};
  self->send(impl_->actor, msg::exited_atom::value, static_cast<std::int32_t>(rank),
             static_cast<std::int32_t>(pid), how);
}

}  // namespace troupe::actors
