// The node: joining the job, the node actor (membership, heartbeats, tensor announcements, role
// hosting, describe), tensors by handle, barriers and shutdown.
#include "actors/node.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "actors/node_impl.hpp"
#include "actors/shutdown_watch.hpp"
#include "memory/error.hpp"

namespace troupe::actors {
namespace {

using ms = std::chrono::milliseconds;

std::string job_name_from_env() {
  if (const char* j = std::getenv("TROUPE_JOB"); j && *j) return j;
  if (const char* s = std::getenv("SLURM_JOB_ID"); s && *s) return std::string("slurm-") + s;
  if (const char* t = std::getenv("TORCHELASTIC_RUN_ID"); t && *t)
    return std::string("torchrun-") + t;
  return "job-" + std::to_string(::getpid());
}

bool is_wildcard(const std::string& a) {
  return a.empty() || a == "0.0.0.0" || a == "::";
}

// -- the node actor ------------------------------------------------------------------------------

struct node_actor_state {
  node::impl* impl = nullptr;
  caf::actor coordinator;
  steady::time_point last_beat = steady::now();
  std::int64_t interval_ms = 0, timeout_ms = 0;
  bool ticking = false;
  std::vector<caf::typed_response_promise<msg::barrier_reply>> barriers;
  static inline const char* name = "troupe_node";
};
using node_actor_t = caf::stateful_actor<node_actor_state>;

// Messages need a sender: this process, the coordinator's, or a member's.
bool allowed(node_actor_t* self) {
  const auto& s = self->current_sender();
  return s && self->state.impl->is_member_node(s->node());
}
bool local(node_actor_t* self) {
  const auto& s = self->current_sender();
  return s && s->node() == self->node();
}

actor_state node_state(node_actor_t* self) {
  auto* I = self->state.impl;
  actor_state a;
  a.name = "node@" + std::to_string(I->rank);
  a.role = "node";
  a.rank = I->rank;
  {
    std::lock_guard<std::mutex> lock(I->mu);
    a.activity = I->activity;
    a.metrics["epoch"] = static_cast<double>(I->epoch);
  }
  a.mailbox_depth = queued_messages(self);
  a.messages_sent = I->msgs_out.load();
  a.messages_received = I->msgs_in.load();
  if (I->ucx) {
    a.bytes_sent = I->ucx->bytes_sent();
    a.bytes_received = I->ucx->bytes_received();
  }
  a.uptime_s = std::chrono::duration<double>(steady::now() - I->born).count();
  a.metrics["roles"] = static_cast<double>(I->roles.size());
  a.collectives = I->watched->records();
  return a;
}

void fail_barriers(node_actor_t* self, const std::string& why) {
  for (auto& rp : self->state.barriers)
    if (rp.pending()) rp.deliver(msg::barrier_reply{false, why});
  self->state.barriers.clear();
}

caf::behavior node_actor(node_actor_t* self, node::impl* impl) {
  self->state.impl = impl;
  // Unknown messages (a peer of another version, or not of this job) are dropped quietly.
  self->set_default_handler(caf::drop);
  self->set_down_handler([self](const caf::down_msg& dm) {
    auto& st = self->state;
    if (st.coordinator && dm.source == st.coordinator.address()) {
      const std::string why =
          "connection to the coordinator " + st.impl->coordinator_endpoint + " closed";
      st.impl->on_coordinator_lost(why);
      fail_barriers(self, why);
    }
  });
  return {
      // Local: start watching the coordinator and sending heartbeats.
      [self](msg::tick_atom, caf::actor coordinator, std::int64_t interval_ms,
             std::int64_t timeout_ms) {
        if (!local(self)) return;
        auto& st = self->state;
        st.coordinator = coordinator;
        st.interval_ms = std::max<std::int64_t>(5, interval_ms);
        st.timeout_ms = timeout_ms;
        st.last_beat = steady::now();
        self->monitor(coordinator);
        if (!st.ticking) {
          st.ticking = true;
          self->send(self, msg::tick_atom::value);
        }
      },
      [self](msg::tick_atom) {
        auto& st = self->state;
        if (!local(self) || !st.coordinator) return;
        auto* I = st.impl;
        std::uint64_t epoch;
        bool gone;
        {
          std::lock_guard<std::mutex> lock(I->mu);
          epoch = I->epoch;
          gone = !I->expelled.empty() || I->shut_down;
        }
        if (gone) {
          st.ticking = false;
          return;
        }
        self->send(st.coordinator, msg::heartbeat{I->rank, epoch});
        const auto silent = std::chrono::duration<double>(steady::now() - st.last_beat).count();
        if (st.timeout_ms > 0 && silent * 1000.0 > static_cast<double>(st.timeout_ms)) {
          char buf[64];
          std::snprintf(buf, sizeof buf, "%.1f s", silent);
          const std::string why =
              "no heartbeat from the coordinator " + I->coordinator_endpoint + " for " + buf;
          I->on_coordinator_lost(why);
          fail_barriers(self, why);
          st.ticking = false;
          return;
        }
        self->delayed_send(self, ms(st.interval_ms), msg::tick_atom::value);
      },
      [self](msg::coordinator_beat&) {
        auto& st = self->state;
        const auto& s = self->current_sender();
        if (s && st.coordinator && s->node() == st.coordinator.node()) st.last_beat = steady::now();
      },
      [self](msg::member_lost& m) {
        auto& st = self->state;
        const auto& s = self->current_sender();
        if (!s || !st.coordinator || s->node() != st.coordinator.node()) return;
        ++st.impl->msgs_in;
        st.last_beat = steady::now();
        st.impl->on_lost(m.rank, m.reason, m.epoch);
      },
      [self](msg::member_left& m) {
        auto& st = self->state;
        const auto& s = self->current_sender();
        if (!s || !st.coordinator || s->node() != st.coordinator.node()) return;
        ++st.impl->msgs_in;
        st.impl->on_left(m.rank, m.epoch);
      },
      [self](msg::member_joined& m) {
        auto& st = self->state;
        const auto& s = self->current_sender();
        if (!s || !st.coordinator || s->node() != st.coordinator.node()) return;
        ++st.impl->msgs_in;
        if (m.rank == st.impl->rank) return;  // our own rejoin
        st.impl->on_joined(m);
        self->send(st.coordinator, msg::joined_ack{st.impl->rank, m.rank, m.epoch});
        ++st.impl->msgs_out;
      },
      // Local: a barrier through the coordinator, failed here if the coordinator is lost.
      [self](msg::barrier_request& req) -> caf::result<msg::barrier_reply> {
        auto& st = self->state;
        if (!local(self) || !st.coordinator)
          return msg::barrier_reply{false, "not connected to a coordinator"};
        {
          std::lock_guard<std::mutex> lock(st.impl->mu);
          if (!st.impl->expelled.empty()) return msg::barrier_reply{false, st.impl->expelled};
        }
        auto rp = self->make_response_promise<msg::barrier_reply>();
        st.barriers.push_back(rp);
        self->request(st.coordinator, caf::infinite, req)
            .then([rp](msg::barrier_reply& r) mutable { rp.deliver(std::move(r)); },
                  [self, rp](caf::error& e) mutable {
                    rp.deliver(msg::barrier_reply{false, self->system().render(e)});
                  });
        // Forget delivered promises now and then.
        auto& b = st.barriers;
        b.erase(std::remove_if(b.begin(), b.end(), [](auto& p) { return !p.pending(); }), b.end());
        return rp;
      },
      [self](msg::tensor_announce& a) {
        auto& st = self->state;
        if (!allowed(self)) return;
        ++st.impl->msgs_in;
        // The announced source must be the sender: a member posing as another rank is refused.
        if (const std::string why = st.impl->announce_refusal(a, self->current_sender()->node());
            !why.empty()) {
          std::fprintf(stderr, "troupe: %s\n", why.c_str());
          return;
        }
        if (a.channel == 0) {
          st.impl->deliver(a);
          return;
        }
        auto it = st.impl->roles.find(a.channel);
        if (it == st.impl->roles.end()) {
          std::fprintf(stderr,
                       "troupe: rank %d: tensor \"%s\" from rank %d for channel %u: no such role "
                       "actor here (dropped; its sender will wait)\n",
                       st.impl->rank, a.name.c_str(), a.source, unsigned(a.channel));
          return;
        }
        self->send(it->second.actor, std::move(a));
      },
      [self](msg::spawn_request& req) -> msg::spawn_reply {
        auto& st = self->state;
        auto* I = st.impl;
        msg::spawn_reply rep;
        if (!allowed(self)) return rep;
        ++I->msgs_in;
        const std::string here = "rank " + std::to_string(I->rank);
        const role_registry::factory* f = I->opts.roles ? I->opts.roles->find(req.role) : nullptr;
        if (!f) {
          std::string names;
          if (I->opts.roles)
            for (const auto& n : I->opts.roles->names()) names += (names.empty() ? "" : ", ") + n;
          rep.error = here + " has no role \"" + req.role +
                      "\" (registered: " + (names.empty() ? std::string("none") : names) + ")";
          return rep;
        }
        if (I->next_channel == 0x7fff) {
          rep.error = here + ": too many role actors";
          return rep;
        }
        role_handle h;
        h.role = req.role;
        h.rank = I->rank;
        h.channel = I->next_channel;
        std::string name = req.name.empty() ? req.role + "@" + std::to_string(I->rank) : req.name;
        auto taken = [&](const std::string& n) {
          for (const auto& [c, r] : I->roles)
            if (r.handle.name == n) return true;
          return false;
        };
        if (taken(name)) {
          if (!req.name.empty()) {
            rep.error = here + " already has an actor named \"" + name + "\"";
            return rep;
          }
          int k = 1;
          while (taken(name + "#" + std::to_string(k))) ++k;
          name += "#" + std::to_string(k);
        }
        h.name = name;
        auto state = std::make_shared<role_actor_state>();
        auto ctx = std::make_shared<role_context>(I->owner, h, state);
        role_builder b;
        try {
          (*f)(b, *ctx);
        } catch (const std::exception& e) {
          rep.error = here + ": the factory of role \"" + req.role + "\" failed: " + e.what();
          return rep;
        }
        caf::actor a = spawn_role_actor(*I, h, std::move(b), state, ctx);
        ++I->next_channel;
        I->roles[h.channel] = local_role{h, a, state};
        rep.ok = true;
        rep.name = h.name;
        rep.role = h.role;
        rep.channel = h.channel;
        rep.actor = a;
        ++I->msgs_out;
        return rep;
      },
      [self](msg::lookup_request& req) -> msg::spawn_reply {
        auto& st = self->state;
        msg::spawn_reply rep;
        if (!allowed(self)) return rep;
        auto it = st.impl->roles.find(req.channel);
        if (it == st.impl->roles.end()) {
          rep.error = "rank " + std::to_string(st.impl->rank) + " has no role actor on channel " +
                      std::to_string(req.channel);
          return rep;
        }
        rep.ok = true;
        rep.name = it->second.handle.name;
        rep.role = it->second.handle.role;
        rep.channel = req.channel;
        rep.actor = it->second.actor;
        return rep;
      },
      [self](msg::stop_request& req) {
        auto& st = self->state;
        if (!allowed(self)) return;
        auto it = st.impl->roles.find(req.channel);
        if (it == st.impl->roles.end()) return;
        self->send_exit(it->second.actor, caf::exit_reason::user_shutdown);
        st.impl->roles.erase(it);
      },
      [self](msg::describe_atom) -> caf::result<std::vector<actor_state>> {
        auto& st = self->state;
        if (!allowed(self)) return caf::sec::request_receiver_down;
        ++st.impl->msgs_in;
        struct gather {
          std::vector<actor_state> states;
          int pending = 1;
          caf::typed_response_promise<std::vector<actor_state>> rp;
        };
        auto g = std::make_shared<gather>();
        g->rp = self->make_response_promise<std::vector<actor_state>>();
        g->states.push_back(node_state(self));
        auto done = [g] {
          if (--g->pending == 0) g->rp.deliver(std::move(g->states));
        };
        for (const auto& [channel, r] : st.impl->roles) {
          ++g->pending;
          auto handle = r.handle;
          auto state = r.state;
          self->request(r.actor, ms(500), msg::describe_atom::value)
              .then(
                  [g, done](actor_state& a) {
                    g->states.push_back(std::move(a));
                    done();
                  },
                  [g, done, handle, state](caf::error&) {
                    auto a = role_state_snapshot(handle, *state, 0);
                    a.activity += " (busy: no answer to describe)";
                    g->states.push_back(std::move(a));
                    done();
                  });
        }
        done();
        ++st.impl->msgs_out;
        return g->rp;
      },
      [self](msg::shutdown_atom) {
        if (!local(self)) return;
        auto& st = self->state;
        for (auto& [c, r] : st.impl->roles)
          self->send_exit(r.actor, caf::exit_reason::user_shutdown);
        st.impl->roles.clear();
        fail_barriers(self, "rank " + std::to_string(st.impl->rank) + " is shutting down");
        self->quit();
      },
  };
}

}  // namespace

// -- tensor_send
// -----------------------------------------------------------------------------------

void tensor_send::wait(std::chrono::milliseconds timeout) {
  if (local_) {
    std::unique_lock<std::mutex> lock(local_->mu);
    auto ready = [&] { return local_->done || !local_->error.empty(); };
    if (timeout.count() > 0) {
      if (!local_->cv.wait_for(lock, timeout, ready))
        TROUPE_FAIL("rank ", info_.source, ": tensor \"", info_.name,
                    "\" to a role actor on this rank was not received within ", timeout.count(),
                    " ms");
    } else {
      local_->cv.wait(lock, ready);
    }
    if (!local_->error.empty())
      TROUPE_FAIL("rank ", info_.source, ": tensor \"", info_.name, "\": ", local_->error);
    return;
  }
  TROUPE_CHECK(t_ && r_.valid(), "tensor_send::wait on an empty handle");
  t_->wait(r_, timeout);
}

bool tensor_send::test() {
  if (local_) {
    std::lock_guard<std::mutex> lock(local_->mu);
    if (!local_->error.empty())
      TROUPE_FAIL("rank ", info_.source, ": tensor \"", info_.name, "\": ", local_->error);
    return local_->done;
  }
  TROUPE_CHECK(t_ && r_.valid(), "tensor_send::test on an empty handle");
  return t_->test(r_);
}

// -- node::impl ----------------------------------------------------------------------------------

std::string node::impl::describe_rank(int r) const {
  if (r >= 0 && r < static_cast<int>(members.size()))
    return "rank " + std::to_string(r) + " (host " + members[r].host + ", pid " +
           std::to_string(members[r].pid) + ")";
  return "rank " + std::to_string(r);
}

bool node::impl::is_member_node(const caf::node_id& n) const {
  if (sys && n == sys->node()) return true;
  if (coordinator_actor && n == coordinator_actor.node()) return true;
  std::lock_guard<std::mutex> lock(mu);
  return member_nodes.count(n) > 0;
}

std::string node::impl::announce_refusal(const msg::tensor_announce& a,
                                         const caf::node_id& sender) {
  std::string who;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (a.source >= 0 && a.source < static_cast<int>(members.size())) {
      if (a.source == rank ? sys && sender == sys->node()
                           : members[a.source].node && sender == members[a.source].node.node())
        return {};
    }
    for (int r = 0; r < static_cast<int>(members.size()); ++r)
      if ((r == rank && sys && sender == sys->node()) ||
          (r != rank && members[r].node && sender == members[r].node.node()))
        who = describe_rank(r);
  }
  const std::uint64_t n = ++refused_announces;
  return "rank " + std::to_string(rank) + " refused tensor \"" + a.name + "\" (seq " +
         std::to_string(a.seq) + ") announced as from rank " + std::to_string(a.source) +
         ": it came from " + (who.empty() ? std::string("a process that is no rank") : who) + " (" +
         std::to_string(n) + " refused announcements)";
}

std::string node::impl::failure_of(int from) const {
  if (!expelled.empty()) return expelled;
  if (from >= 0 && from < static_cast<int>(lost.size())) {
    if (!lost[from].empty()) return "rank " + std::to_string(from) + " lost: " + lost[from];
    if (left[from]) return "rank " + std::to_string(from) + " left the job";
  }
  return {};
}

void node::impl::post_event(member_event e) {
  {
    std::lock_guard<std::mutex> lock(cb_mu);
    events.push_back(std::move(e));
  }
  cb_cv.notify_all();
}

void node::impl::on_lost(int r, const std::string& reason, std::uint64_t ep) {
  std::vector<int> fail;
  std::string why = reason;
  {
    std::lock_guard<std::mutex> lock(mu);
    epoch = std::max(epoch, ep);
    if (r == rank) {
      if (!expelled.empty()) return;
      expelled = "rank " + std::to_string(rank) + " (this rank) was declared lost by the " +
                 "coordinator: " + reason;
      why = expelled;
      for (int p = 0; p < world; ++p)
        if (p != rank) fail.push_back(p);
    } else if (r >= 0 && r < world && lost[r].empty()) {
      lost[r] = reason;
      fail.push_back(r);
    } else {
      return;
    }
  }
  if (ucx)
    for (int p : fail) ucx->fail_peer(p, why);
  cv.notify_all();
  post_event(member_event{member_event::lost, r, reason, ep});
}

void node::impl::on_left(int r, std::uint64_t ep) {
  {
    std::lock_guard<std::mutex> lock(mu);
    epoch = std::max(epoch, ep);
    if (r < 0 || r >= world || left[r]) return;
    left[r] = true;
  }
  cv.notify_all();
  post_event(member_event{member_event::left, r, "left the job", ep});
}

void node::impl::on_joined(const msg::member_joined& m) {
  const int r = m.rank;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (r < 0 || r >= world || r == rank) return;
    epoch = std::max(epoch, m.epoch);
    members[r] = m.info;
    lost[r].clear();
    left[r] = false;
    ++incarnation[r];
    if (m.info.node) member_nodes.insert(m.info.node.node());
    // The new process numbers its tensors from 0 again, in both directions.
    for (auto it = send_seq.begin(); it != send_seq.end();)
      it = it->first.first == r ? send_seq.erase(it) : std::next(it);
    next_claim[r] = 0;
    for (auto it = inbox.begin(); it != inbox.end();)
      it = it->source == r ? inbox.erase(it) : std::next(it);
    for (auto it = claimed.begin(); it != claimed.end();)
      it = it->first.first == r ? claimed.erase(it) : std::next(it);
    for (auto it = unwanted.begin(); it != unwanted.end();)
      it = it->first == r ? unwanted.erase(it) : std::next(it);
  }
  {
    std::lock_guard<std::mutex> lock(connect_mu);
    if (r < static_cast<int>(direct.size())) direct[r] = nullptr;
  }
  if (ucx)
    ucx->connect(
        r, std::span<const std::uint8_t>(
               reinterpret_cast<const std::uint8_t*>(m.ucx_address.data()), m.ucx_address.size()));
  cv.notify_all();
  post_event(member_event{
      member_event::joined, r,
      "rejoined (host " + m.info.host + ", pid " + std::to_string(m.info.pid) + ")", m.epoch});
}

void node::impl::on_coordinator_lost(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (shut_down || !expelled.empty()) return;
    expelled = "coordinator lost: " + reason;
  }
  std::fprintf(stderr, "troupe: rank %d: coordinator lost: %s\n", rank, reason.c_str());
  if (ucx)
    for (int p = 0; p < world; ++p)
      if (p != rank) ucx->fail_peer(p, "coordinator lost: " + reason);
  cv.notify_all();
  post_event(member_event{member_event::lost, -1, reason, epoch});
}

void node::impl::deliver(const msg::tensor_announce& a) {
  tensor_info t;
  t.source = a.source;
  t.id = a.id;
  t.seq = a.seq;
  t.channel = a.channel;
  t.tag = tensor_tag(a.channel, a.seq);
  t.type = static_cast<dtype>(a.type);
  t.shape = a.shape;
  t.bytes = a.bytes;
  t.name = a.name;
  {
    std::lock_guard<std::mutex> lock(mu);
    if (a.source < 0 || a.source >= world) return;
    const auto ahead = static_cast<std::int32_t>(a.seq - next_claim[a.source]);
    if (ahead < 0 && unwanted.erase({a.source, a.seq}))
      return;  // its bytes were taken by wait_data() already
    if (ahead < 0)
      claimed[{a.source, a.seq}] = std::move(t);
    else
      inbox.push_back(std::move(t));
  }
  cv.notify_all();
}

caf::actor node::impl::peer(int r) {
  TROUPE_CHECK(r >= 0 && r < world, "rank ", rank, ": no rank ", r, " in a world of ", world);
  if (r == rank) return node_actor;
  std::lock_guard<std::mutex> lock(connect_mu);
  if (direct[r]) return direct[r];
  msg::member_info m;
  {
    std::lock_guard<std::mutex> l2(mu);
    m = members[r];
  }
  // Over TLS only the lower rank of a pair connects: CAF 0.17's openssl module breaks a second
  // connection between two processes already connected (requests on both, and the coordinator's,
  // time out; a small program showed it), which plain BASP absorbs. The higher rank's messages go
  // through the coordinator's process until the lower rank connects, then over that connection.
  if (detail::uses_tls(*sys) && r < rank) {
    direct[r] = m.node;
    return direct[r];
  }
  auto a = detail::connect_actor(*sys, m.endpoint_host, m.endpoint_port);
  if (a) {
    direct[r] = *a;
  } else {
    // Routed through the coordinator's process instead: slower, but it works.
    std::fprintf(stderr,
                 "troupe: rank %d: no direct connection to rank %d at %s:%u (%s); routing "
                 "through the coordinator\n",
                 rank, r, m.endpoint_host.c_str(), unsigned(m.endpoint_port),
                 sys->render(a.error()).c_str());
    direct[r] = m.node;
  }
  return direct[r];
}

// -- node ----------------------------------------------------------------------------------------

namespace {

// Stops everything the impl started, in an order that never waits on a dead peer. Each step is
// named to `watch` (when given), which reports a step that takes long.
void teardown(node::impl& I, detail::shutdown_watch* watch = nullptr) {
  auto stage = [&](const std::string& what) {
    if (watch != nullptr) watch->stage(what);
  };
  {
    std::lock_guard<std::mutex> lock(I.mu);
    I.shut_down = true;
  }
  if (I.ucx)
    for (int p = 0; p < I.world; ++p)
      if (p != I.rank) I.ucx->fail_peer(p, "rank " + std::to_string(I.rank) + " is shutting down");
  {
    std::lock_guard<std::mutex> lock(I.mu);
    for (auto& [key, local] : I.local_sends) {
      std::lock_guard<std::mutex> l2(local->mu);
      local->error = "rank " + std::to_string(I.rank) + " is shutting down";
      local->cv.notify_all();
    }
    I.local_sends.clear();
  }
  if (I.node_actor) caf::send_as(I.node_actor, I.node_actor, msg::shutdown_atom::value);
  stage("waiting for the role actors to stop");
  {
    // Role actors finish the message at hand (a blocked transfer fails above), then stop.
    std::unique_lock<std::mutex> lock(I.roles_mu);
    if (!I.roles_cv.wait_for(lock, std::chrono::seconds(10), [&] { return I.live_roles == 0; }))
      std::fprintf(stderr, "troupe: rank %d: %d role actors did not stop within 10 s\n", I.rank,
                   I.live_roles);
  }
  if (I.node_actor) caf::anon_send_exit(I.node_actor, caf::exit_reason::user_shutdown);
  I.node_actor = nullptr;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    for (auto& a : I.extra_actors) caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
    I.extra_actors.clear();
  }
  I.coordinator_actor = nullptr;
  {
    std::lock_guard<std::mutex> lock(I.connect_mu);
    I.direct.clear();
  }
  {
    std::lock_guard<std::mutex> lock(I.mu);
    for (auto& m : I.members) m.node = nullptr;
  }
  {
    std::lock_guard<std::mutex> lock(I.cb_mu);
    I.cb_stop = true;
  }
  I.cb_cv.notify_all();
  stage("joining the membership callback thread (a callback has not returned)");
  if (I.dispatcher.joinable()) I.dispatcher.join();
  stage("closing the UCX transport");
  I.ucx.reset();
  if (I.sys)
    stage("stopping the CAF actor system (" + std::to_string(I.sys->registry().running()) +
          " actors were running; it waits for every actor and detached actor thread to end)");
  I.sys.reset();
  stage("stopping the hosted coordinator");
  I.cfg.reset();
  I.hosted.reset();
}

}  // namespace

node::node(node_options options) : impl_(std::make_unique<impl>(*this)) {
  auto& I = *impl_;
  I.opts = std::move(options);
  if (I.opts.join) {
    I.info = *I.opts.join;
  } else {
    auto j = join_info_from_env();
    if (!j) TROUPE_FAIL("cannot join a troupe job: ", j.error_message());
    I.info = *j;
  }
  I.rank = I.info.rank;
  I.local_rank = I.info.local_rank;
  I.coordinator_endpoint = I.info.coordinator;
  std::string me = I.rank < 0 ? std::string("a joiner") : "rank " + std::to_string(I.rank);
  try {
    const auto deadline = steady::now() + I.opts.join_timeout;
    auto remaining = [&] {
      return std::max(ms(1), std::chrono::duration_cast<ms>(deadline - steady::now()));
    };
    auto [chost, cport] = detail::split_endpoint(I.info.coordinator);
    if (chost.empty())
      TROUPE_FAIL(me, ": the coordinator address \"", I.info.coordinator, "\" is not host:port");
    if (I.info.tls.enabled()) check_tls(I.info.tls, tls_source::environment);
    if (I.info.host_coordinator) {
      coordinator_options co;
      co.job = job_name_from_env();
      co.token = I.info.token;
      co.world_size = I.info.world_size;
      co.bind = I.info.coordinator_bind;
      co.port = cport;
      co.heartbeat_timeout = I.opts.heartbeat_timeout;
      co.tls = I.info.tls;
      I.hosted = std::make_unique<actors::coordinator>(co);
    }
    I.cfg = detail::make_caf_config(I.opts.caf_threads, &I.info.tls);
    I.sys = std::make_unique<caf::actor_system>(*I.cfg);
    I.node_actor = I.sys->spawn(node_actor, &I);
    const char* bind = is_wildcard(I.info.bind) ? nullptr : I.info.bind.c_str();
    auto port = detail::publish_actor(*I.sys, I.node_actor, 0, bind);
    if (!port)
      TROUPE_FAIL(me, ": cannot listen on ", I.info.bind, ": ", I.sys->render(port.error()));
    const std::string endpoint_host = bind ? I.info.bind : this_host();

    // The coordinator may start after us (Slurm, torchrun): retry until the deadline.
    for (;;) {
      auto c = detail::connect_actor(*I.sys, chost, cport);
      if (c) {
        I.coordinator_actor = *c;
        break;
      }
      // It listens, but the handshake failed: waiting will not help (TLS on one side only).
      if (c.error() == caf::sec::disconnect_during_handshake)
        TROUPE_FAIL(me, ": cannot join the coordinator at ", I.info.coordinator, ": ",
                    I.sys->render(c.error()), detail::handshake_hint(*I.sys, c.error()));
      if (steady::now() >= deadline)
        TROUPE_FAIL(me, ": cannot reach the coordinator at ", I.info.coordinator, ": ",
                    I.sys->render(c.error()), " (tried for ", I.opts.join_timeout.count(), " ms)");
      std::this_thread::sleep_for(ms(200));
    }

    caf::scoped_actor self{*I.sys};
    std::string failure;
    auto on_error = [&](caf::error& e) { failure = I.sys->render(e); };

    msg::join_request req;
    req.token = I.info.token;
    req.rank = I.rank;
    req.world_size = I.info.world_size;
    req.local_rank = I.local_rank;
    req.host = this_host();
    req.pid = static_cast<std::int32_t>(::getpid());
    req.endpoint_host = endpoint_host;
    req.endpoint_port = *port;
    req.node = I.node_actor;
    msg::join_reply rep;
    self->request(I.coordinator_actor, remaining(), std::move(req))
        .receive([&](msg::join_reply& r) { rep = std::move(r); }, on_error);
    if (!failure.empty())
      TROUPE_FAIL(me, ": joining the coordinator at ", I.info.coordinator, " failed: ", failure,
                  " (waited for the whole world for up to ", I.opts.join_timeout.count(), " ms)");
    if (!rep.accepted)
      TROUPE_FAIL("coordinator ", I.info.coordinator, " refused to join: ", rep.reason);

    // A joiner (troupe launch --join) learns the rank whose place it takes.
    if (I.rank < 0) {
      TROUPE_CHECK(rep.rank >= 0 && rep.rank < rep.world_size, "a joiner: coordinator ",
                   I.info.coordinator, " gave rank ", rep.rank, " in a world of ", rep.world_size);
      I.rank = rep.rank;
      I.info.rank = rep.rank;
      me = "rank " + std::to_string(I.rank) + " (a joiner)";
    }
    I.world = rep.world_size;
    I.job_name = rep.job;
    I.heartbeat_interval_ms = rep.heartbeat_interval_ms;
    I.heartbeat_timeout_ms = rep.heartbeat_timeout_ms;
    {
      std::lock_guard<std::mutex> lock(I.mu);
      I.members = rep.members;
      I.lost.assign(I.world, {});
      I.left.assign(I.world, false);
      I.next_claim.assign(I.world, 0);
      I.incarnation.assign(I.world, 0);
      // Rejoining a running job: some ranks may be gone.
      for (int p = 0; p < I.world && p < static_cast<int>(rep.member_status.size()); ++p) {
        const auto& st = rep.member_status[p];
        if (st == "left the job")
          I.left[p] = true;
        else if (!st.empty())
          I.lost[p] = st.rfind("lost: ", 0) == 0 ? st.substr(6) : st;
      }
      for (const auto& m : I.members)
        if (m.node) I.member_nodes.insert(m.node.node());
    }
    I.direct.assign(I.world, nullptr);
    caf::send_as(I.node_actor, I.node_actor, msg::tick_atom::value, I.coordinator_actor,
                 I.heartbeat_interval_ms, I.heartbeat_timeout_ms);

    collective::ucx_transport_options uo;
    uo.rank = I.rank;
    uo.size = I.world;
    uo.net_device = I.info.net_device.empty() ? std::string("all") : I.info.net_device;
    if (I.opts.survive_local_loss) uo.error_mode = collective::ucx_error_mode::peer;
    uo.token = I.info.token;
    uo.job = I.job_name;
    uo.handshake_timeout = I.opts.join_timeout;
    I.ucx = std::make_unique<collective::ucx_transport>(uo);
    const auto addr = I.ucx->address();
    msg::address_reply arep;
    self->request(I.coordinator_actor, remaining(),
                  msg::address_request{I.rank, std::vector<char>(addr.begin(), addr.end())})
        .receive([&](msg::address_reply& r) { arep = std::move(r); }, on_error);
    if (!failure.empty() || !arep.ok)
      TROUPE_FAIL(me, ": exchanging transport addresses through ", I.info.coordinator,
                  " failed: ", failure.empty() ? arep.error : failure);
    TROUPE_CHECK(static_cast<int>(arep.addresses.size()) == I.world, me, ": got ",
                 arep.addresses.size(), " transport addresses for a world of ", I.world);
    for (int p = 0; p < I.world; ++p) {
      if (p == I.rank) continue;
      std::string gone;
      {
        std::lock_guard<std::mutex> lock(I.mu);
        gone = I.failure_of(p);
      }
      if (!gone.empty()) {
        I.ucx->fail_peer(p, gone);  // not in the job now: nothing to connect to
        continue;
      }
      const auto& a = arep.addresses[p];
      I.ucx->connect(p, std::span<const std::uint8_t>(
                            reinterpret_cast<const std::uint8_t*>(a.data()), a.size()));
    }
    // Every endpoint proves job membership (the token, never sent) before any tensor moves.
    I.ucx->authenticate(remaining());
    msg::ready_reply rrep;
    self->request(I.coordinator_actor, remaining(), msg::ready_request{I.rank})
        .receive([&](msg::ready_reply& r) { rrep = std::move(r); }, on_error);
    if (!failure.empty() || !rrep.ok)
      TROUPE_FAIL(me, ": waiting for every rank to connect failed: ",
                  failure.empty() ? rrep.error : failure);
    {
      std::lock_guard<std::mutex> lock(I.mu);
      I.epoch = std::max(I.epoch, rrep.epoch);
      I.started = true;
    }
    I.dispatcher = std::thread([&I] {
      std::unique_lock<std::mutex> lock(I.cb_mu);
      for (;;) {
        I.cb_cv.wait(lock, [&] { return I.cb_stop || !I.events.empty(); });
        if (I.events.empty() && I.cb_stop) return;
        if (I.events.empty()) continue;
        member_event e = std::move(I.events.front());
        I.events.pop_front();
        auto cbs = I.callbacks;
        I.dispatching = true;
        lock.unlock();
        for (auto& [id, fn] : cbs) {
          try {
            fn(e);
          } catch (const std::exception& ex) {
            std::fprintf(stderr, "troupe: rank %d: a membership callback threw: %s\n", I.rank,
                         ex.what());
          }
        }
        lock.lock();
        I.dispatching = false;
        I.cb_cv.notify_all();
      }
    });
  } catch (...) {
    teardown(I);
    throw;
  }
}

node::~node() {
  try {
    shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe: rank %d: shutdown: %s\n", impl_->rank, e.what());
  }
}

int node::rank() const {
  return impl_->rank;
}
int node::world_size() const {
  return impl_->world;
}
int node::local_rank() const {
  return impl_->local_rank;
}
const std::string& node::job() const {
  return impl_->job_name;
}
const std::string& node::coordinator() const {
  return impl_->coordinator_endpoint;
}

std::uint64_t node::epoch() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->epoch;
}

std::vector<int> node::alive() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  std::vector<int> out;
  for (int r = 0; r < impl_->world; ++r)
    if (impl_->lost[r].empty() && !impl_->left[r]) out.push_back(r);
  return out;
}

std::string node::lost_reason(int rank) const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  if (rank < 0 || rank >= impl_->world) return "no rank " + std::to_string(rank);
  if (!impl_->lost[rank].empty()) return impl_->lost[rank];
  if (impl_->left[rank]) return "left the job";
  return {};
}

collective_watch node::watch(collective::communicator& c) {
  return collective_watch(impl_->watched, impl_->watched->add(c));
}

collective::transport& node::transport() {
  TROUPE_CHECK(impl_->ucx, "rank ", impl_->rank, ": the node is shut down");
  return *impl_->ucx;
}

namespace {

tensor_send send_on(node::impl& I, int dest, std::uint16_t channel, const void* data, dtype type,
                    std::span<const std::int64_t> shape, const std::string& name,
                    std::uint64_t id) {
  TROUPE_CHECK(I.ucx, "rank ", I.rank, ": send_tensor after shutdown");
  TROUPE_CHECK(dest >= 0 && dest < I.world && (dest != I.rank || channel != 0), "rank ", I.rank,
               ": send_tensor to rank ", dest, " (the world has ", I.world,
               " ranks; a rank sends to itself only to its role actors)");
  std::size_t numel = 1;
  for (auto d : shape) {
    TROUPE_CHECK(d >= 0, "rank ", I.rank, ": send_tensor \"", name, "\": negative dimension ", d);
    numel *= static_cast<std::size_t>(d);
  }
  const std::size_t bytes = numel * dtype_size(type);
  caf::actor to = I.peer(dest);
  std::uint32_t seq;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    const std::string f = I.failure_of(dest);
    if (!f.empty())
      TROUPE_FAIL("rank ", I.rank, ": send_tensor \"", name, "\" to rank ", dest, ": ", f);
    seq = I.send_seq[{dest, channel}]++;
  }
  tensor_info info;
  info.source = I.rank;
  info.id = id ? id : I.next_buffer_id++;
  info.seq = seq;
  info.channel = channel;
  info.tag = tensor_tag(channel, seq);
  info.type = type;
  info.shape.assign(shape.begin(), shape.end());
  info.bytes = bytes;
  info.name = name;
  // The announcement is queued first, then the bytes are posted at once: a receiver that
  // pre-posted its receive (receive_next) takes them without waiting for the announcement.
  // (Yielding here so that the middleman writes the announcement first cost those receivers up
  // to 20% at 4 MiB.)
  msg::tensor_announce a{I.rank,     info.id, seq, channel, static_cast<std::uint8_t>(type),
                         info.shape, bytes,   name};
  if (dest == I.rank) {
    // To a role actor here: the bytes stay put until it receives them (one copy).
    auto local = std::make_shared<detail::local_transfer>();
    local->data = data;
    local->bytes = bytes;
    {
      std::lock_guard<std::mutex> lock(I.mu);
      I.local_sends[{channel, seq}] = local;
    }
    caf::send_as(I.node_actor, to, std::move(a));
    ++I.msgs_out;
    return tensor_send(std::move(local), std::move(info));
  }
  caf::send_as(I.node_actor, to, std::move(a));
  ++I.msgs_out;
  auto req = I.ucx->isend(dest, info.tag, data, bytes);
  return tensor_send(I.ucx.get(), std::move(req), std::move(info));
}

std::string timeout_text(ms t) {
  return std::to_string(t.count()) + " ms";
}

}  // namespace

tensor_send node::send_tensor(int dest, const void* data, dtype type,
                              std::span<const std::int64_t> shape, const std::string& name,
                              std::uint64_t id) {
  return send_on(*impl_, dest, 0, data, type, shape, name, id);
}

tensor_send node::send_tensor(const role_handle& dest, const void* data, dtype type,
                              std::span<const std::int64_t> shape, const std::string& name,
                              std::uint64_t id) {
  TROUPE_CHECK(dest.valid(), "rank ", impl_->rank, ": send_tensor to an invalid role handle \"",
               dest.name, "\"");
  return send_on(*impl_, dest.rank, dest.channel, data, type, shape, name, id);
}

tensor_info node::next_tensor(std::chrono::milliseconds timeout, int from) {
  auto& I = *impl_;
  TROUPE_CHECK(from >= -1 && from < I.world, "rank ", I.rank, ": next_tensor from rank ", from,
               " (world of ", I.world, ")");
  const auto deadline = steady::now() + timeout;
  std::unique_lock<std::mutex> lock(I.mu);
  for (;;) {
    for (auto it = I.inbox.begin(); it != I.inbox.end(); ++it) {
      if ((from < 0 || it->source == from) && it->seq == I.next_claim[it->source]) {
        tensor_info t = std::move(*it);
        I.inbox.erase(it);
        ++I.next_claim[t.source];
        return t;
      }
    }
    const std::string f = I.failure_of(from);
    if (!f.empty())
      TROUPE_FAIL("rank ", I.rank, ": waiting for a tensor from ",
                  from < 0 ? std::string("any rank") : "rank " + std::to_string(from), ": ", f);
    if (timeout.count() > 0) {
      if (I.cv.wait_until(lock, deadline) == std::cv_status::timeout && steady::now() >= deadline)
        TROUPE_FAIL("rank ", I.rank, ": no tensor from ",
                    from < 0 ? std::string("any rank") : "rank " + std::to_string(from), " within ",
                    timeout_text(timeout));
    } else {
      I.cv.wait(lock);
    }
  }
}

void node::receive(const tensor_info& info, void* dst, std::size_t bytes,
                   std::chrono::milliseconds timeout) {
  auto& I = *impl_;
  TROUPE_CHECK(I.ucx, "rank ", I.rank, ": receive after shutdown");
  TROUPE_CHECK(bytes == info.bytes, "rank ", I.rank, ": tensor \"", info.name, "\" from rank ",
               info.source, " has ", info.bytes, " bytes, the buffer ", bytes);
  if (info.source == I.rank) {
    std::shared_ptr<detail::local_transfer> local;
    {
      std::lock_guard<std::mutex> lock(I.mu);
      auto it = I.local_sends.find({info.channel, info.seq});
      TROUPE_CHECK(it != I.local_sends.end(), "rank ", I.rank, ": tensor \"", info.name,
                   "\" from this rank was received already (or never sent)");
      local = it->second;
      I.local_sends.erase(it);
    }
    std::lock_guard<std::mutex> lock(local->mu);
    if (bytes) std::memcpy(dst, local->data, bytes);
    local->done = true;
    local->cv.notify_all();
    return;
  }
  I.set_activity("receiving \"" + info.name + "\" from rank " + std::to_string(info.source));
  auto req = I.ucx->irecv(info.source, info.tag, dst, bytes);
  I.ucx->wait(req, timeout);
  I.set_activity("running");
}

received_tensor node::receive(const tensor_info& info, std::chrono::milliseconds timeout) {
  received_tensor r;
  r.info = info;
  r.data = memory::buffer::host(std::max<std::size_t>(info.bytes, 1));
  receive(info, r.data.data(), info.bytes, timeout);
  return r;
}

tensor_info node::receive_next(int from, void* dst, std::size_t bytes,
                               std::chrono::milliseconds timeout) {
  auto r = post_receive_next(from, dst, bytes);
  return finish_receive(r, timeout, true);
}

tensor_recv node::post_receive_next(int from, void* dst, std::size_t bytes) {
  auto& I = *impl_;
  TROUPE_CHECK(I.ucx, "rank ", I.rank, ": receive_next after shutdown");
  TROUPE_CHECK(from >= 0 && from < I.world && from != I.rank, "rank ", I.rank,
               ": receive_next from rank ", from, " (world of ", I.world, ")");
  tensor_recv r;
  r.n_ = this;
  r.from_ = from;
  r.bytes_ = bytes;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    const std::string f = I.failure_of(from);
    if (!f.empty()) TROUPE_FAIL("rank ", I.rank, ": receive_next from rank ", from, ": ", f);
    r.seq_ = I.next_claim[from]++;
    for (auto it = I.inbox.begin(); it != I.inbox.end(); ++it)
      if (it->source == from && it->seq == r.seq_) {
        r.info_ = std::move(*it);
        I.inbox.erase(it);
        break;
      }
  }
  r.r_ = I.ucx->irecv(from, tensor_tag(0, r.seq_), dst, bytes);
  return r;
}

tensor_info tensor_recv::wait(std::chrono::milliseconds timeout) {
  TROUPE_CHECK(n_, "tensor_recv::wait on an empty handle");
  return n_->finish_receive(*this, timeout, true);
}

tensor_info tensor_recv::wait_data(std::chrono::milliseconds timeout) {
  TROUPE_CHECK(n_, "tensor_recv::wait_data on an empty handle");
  return n_->finish_receive(*this, timeout, false);
}

tensor_info node::finish_receive(tensor_recv& r, std::chrono::milliseconds timeout,
                                 bool announced) {
  auto& I = *impl_;
  const auto deadline = steady::now() + timeout;
  const int from = r.from_;
  I.ucx->wait(r.r_, timeout);
  if (!r.info_ && !announced) {
    std::lock_guard<std::mutex> lock(I.mu);
    auto it = I.claimed.find({from, r.seq_});
    if (it != I.claimed.end()) {
      r.info_ = std::move(it->second);
      I.claimed.erase(it);
    } else {
      I.unwanted.insert({from, r.seq_});
      tensor_info t;
      t.source = from;
      t.seq = r.seq_;
      t.tag = tensor_tag(0, r.seq_);
      t.bytes = r.bytes_;
      r.info_ = std::move(t);
    }
  }
  if (!r.info_) {
    std::unique_lock<std::mutex> lock(I.mu);
    for (;;) {
      auto it = I.claimed.find({from, r.seq_});
      if (it != I.claimed.end()) {
        r.info_ = std::move(it->second);
        I.claimed.erase(it);
        break;
      }
      const std::string f = I.failure_of(from);
      if (!f.empty()) TROUPE_FAIL("rank ", I.rank, ": receive_next from rank ", from, ": ", f);
      if (timeout.count() > 0) {
        if (I.cv.wait_until(lock, deadline) == std::cv_status::timeout && steady::now() >= deadline)
          TROUPE_FAIL("rank ", I.rank, ": the announcement of tensor ", r.seq_, " from rank ", from,
                      " did not come within ", timeout_text(timeout));
      } else {
        I.cv.wait(lock);
      }
    }
  }
  TROUPE_CHECK(r.info_->bytes == r.bytes_, "rank ", I.rank, ": tensor \"", r.info_->name,
               "\" from rank ", from, " has ", r.info_->bytes, " bytes, the buffer ", r.bytes_);
  r.n_ = nullptr;
  return *r.info_;
}

int node::on_membership(std::function<void(const member_event&)> fn) {
  std::lock_guard<std::mutex> lock(impl_->cb_mu);
  const int id = impl_->next_callback++;
  impl_->callbacks[id] = std::move(fn);
  return id;
}

void node::remove_membership_callback(int id) {
  auto& I = *impl_;
  std::unique_lock<std::mutex> lock(I.cb_mu);
  I.callbacks.erase(id);
  // Once this returns the callback does not run any more (unless this is the callback itself).
  if (std::this_thread::get_id() != I.dispatcher.get_id())
    I.cb_cv.wait(lock, [&] { return !I.dispatching; });
}

void node::barrier(const std::string& name, std::chrono::milliseconds timeout) {
  auto& I = *impl_;
  TROUPE_CHECK(I.sys && I.node_actor, "rank ", I.rank, ": barrier after shutdown");
  I.set_activity("barrier \"" + name + "\"");
  caf::scoped_actor self{*I.sys};
  msg::barrier_reply rep;
  std::string failure;
  const caf::duration d =
      timeout.count() > 0 ? caf::duration{timeout} : caf::duration{caf::infinite};
  self->request(I.node_actor, d, msg::barrier_request{I.rank, name})
      .receive([&](msg::barrier_reply& r) { rep = std::move(r); },
               [&](caf::error& e) { failure = I.sys->render(e); });
  I.set_activity("running");
  if (!failure.empty())
    TROUPE_FAIL("rank ", I.rank, ": barrier \"", name, "\": ",
                failure.find("timeout") != std::string::npos
                    ? "timed out after " + timeout_text(timeout)
                    : failure);
  if (!rep.ok) TROUPE_FAIL("rank ", I.rank, ": ", rep.error);
}

void node::note_event(const std::string& kind, const std::string& detail,
                      std::chrono::milliseconds timeout) {
  auto& I = *impl_;
  TROUPE_CHECK(I.sys && I.coordinator_actor, "rank ", I.rank, ": note_event(\"", kind,
               "\") after shutdown");
  caf::scoped_actor self{*I.sys};
  msg::barrier_reply rep;
  std::string failure;
  self->request(I.coordinator_actor, caf::duration{timeout}, msg::job_event{I.rank, kind, detail})
      .receive([&](msg::barrier_reply& r) { rep = std::move(r); },
               [&](caf::error& e) { failure = I.sys->render(e); });
  if (!failure.empty())
    TROUPE_FAIL(
        "rank ", I.rank, ": note_event(\"", kind, "\"): the coordinator did not record it: ",
        failure.find("timeout") != std::string::npos ? "no answer within " + timeout_text(timeout)
                                                     : failure);
  if (!rep.ok) TROUPE_FAIL("rank ", I.rank, ": note_event(\"", kind, "\") refused: ", rep.error);
}

void node::shutdown() {
  auto& I = *impl_;
  if (!I.sys) return;
  bool expelled;
  {
    std::lock_guard<std::mutex> lock(I.mu);
    expelled = !I.expelled.empty();
  }
  if (I.live_jobs.load() > 0)
    std::fprintf(stderr, "troupe: rank %d: shutdown while %d job objects are alive\n", I.rank,
                 I.live_jobs.load());
  // Best effort: without a thread (EAGAIN) or with shutdown_report <= 0 it says nothing.
  detail::shutdown_watch watch("troupe: rank " + std::to_string(I.rank),
                               "leaving the job (waiting up to 3 s for the coordinator)",
                               I.opts.shutdown_report);
  if (I.coordinator_actor && !expelled) {
    caf::scoped_actor self{*I.sys};
    self->request(I.coordinator_actor, ms(3000), msg::leave_request{I.rank})
        .receive([](msg::barrier_reply&) {}, [](caf::error&) {});
  }
  if (I.hosted) {
    // The other ranks still need the coordinator: wait for them to leave (or be lost).
    watch.stage("hosting the coordinator until every rank left");
    if (!I.hosted->wait_finished(std::chrono::minutes(10)))
      std::fprintf(stderr, "troupe: rank %d: stopping the coordinator before every rank left\n",
                   I.rank);
  }
  watch.stage("failing the transfers in flight");
  teardown(I, &watch);
}

}  // namespace troupe::actors
