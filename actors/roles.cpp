// Role actors (detached CAF actors running user handlers), their context, the registry, and the
// driver's job API (spawn, ask, ask_all with timeouts and loss detection).
#include "actors/roles.hpp"

#include <caf/all.hpp>
#include <caf/io/all.hpp>

#include <algorithm>
#include <cstdio>

#include "actors/node_impl.hpp"
#include "memory/error.hpp"

namespace troupe::actors {
namespace {

using ms = std::chrono::milliseconds;

struct role_actor_data {
  node::impl* host = nullptr;
  role_handle handle;
  role_builder builder;
  std::shared_ptr<role_actor_state> state;
  std::shared_ptr<role_context> ctx;
  bool stopped = false;
  static inline const char* name = "troupe_role";
};
using role_actor_t = caf::stateful_actor<role_actor_data>;

void run_stop(role_actor_t* self) {
  auto& d = self->state;
  if (d.stopped) return;
  d.stopped = true;
  if (d.builder.stop_handler()) {
    try {
      d.builder.stop_handler()(*d.ctx);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "troupe: %s: on_stop threw: %s\n", d.handle.name.c_str(), e.what());
    }
  }
}

caf::behavior role_actor(role_actor_t* self, node::impl* n, role_handle h, role_builder b,
                         std::shared_ptr<role_actor_state> state,
                         std::shared_ptr<role_context> ctx) {
  auto& d = self->state;
  d.host = n;
  d.handle = std::move(h);
  d.builder = std::move(b);
  d.state = std::move(state);
  d.ctx = std::move(ctx);
  {
    std::lock_guard<std::mutex> lock(n->roles_mu);
    ++n->live_roles;
  }
  self->attach_functor([n] {
    {
      std::lock_guard<std::mutex> lock(n->roles_mu);
      --n->live_roles;
    }
    n->roles_cv.notify_all();
  });
  // Unknown messages (a peer of another version, or not of this job) are dropped quietly.
  self->set_default_handler(caf::drop);
  self->set_exit_handler([self](caf::exit_msg& m) {
    run_stop(self);
    self->quit(m.reason);
  });
  return {
      [self](msg::role_request& req) {
        auto& d = self->state;
        const auto& sender = self->current_sender();
        if (!sender || !d.host->is_member_node(sender->node())) return;
        ++d.state->msgs_in;
        d.state->bytes_in += req.payload.size();
        msg::role_reply rep;
        rep.corr = req.corr;
        const auto& hs = d.builder.handlers();
        auto it = hs.find(req.kind);
        if (it == hs.end()) {
          rep.error = d.handle.name + " (rank " + std::to_string(d.handle.rank) +
                      ") has no handler for requests of kind \"" + req.kind + "\"";
        } else {
          try {
            rep.payload = it->second.fn(*d.ctx, req.payload);
            rep.kind = it->second.reply_kind;
            rep.ok = true;
          } catch (const std::exception& e) {
            rep.error = d.handle.name + " (rank " + std::to_string(d.handle.rank) +
                        ") failed on \"" + req.kind + "\": " + e.what();
          }
        }
        ++d.state->msgs_out;
        d.state->bytes_out += rep.payload.size();
        self->send(caf::actor_cast<caf::actor>(sender), std::move(rep));
      },
      [self](msg::tensor_announce& a) {
        auto& d = self->state;
        const auto& sender = self->current_sender();
        if (!sender || sender->node() != self->node()) return;  // forwarded by our node actor
        ++d.state->msgs_in;
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
        try {
          if (d.builder.tensor_handler()) {
            d.builder.tensor_handler()(*d.ctx, t);
          } else {
            std::fprintf(stderr,
                         "troupe: %s (rank %d) has no tensor handler: tensor \"%s\" from rank %d "
                         "received and dropped\n",
                         d.handle.name.c_str(), d.handle.rank, t.name.c_str(), t.source);
            d.ctx->receive(t);
          }
        } catch (const std::exception& e) {
          std::fprintf(stderr, "troupe: %s (rank %d): tensor handler failed: %s\n",
                       d.handle.name.c_str(), d.handle.rank, e.what());
        }
      },
      [self](msg::describe_atom) -> actor_state {
        auto& d = self->state;
        return role_state_snapshot(d.handle, *d.state, queued_messages(self));
      },
  };
}

}  // namespace

caf::actor spawn_role_actor(node::impl& n, const role_handle& handle, role_builder builder,
                            std::shared_ptr<role_actor_state> state,
                            std::shared_ptr<role_context> ctx) {
  return n.sys->spawn<caf::detached>(role_actor, &n, handle, std::move(builder), std::move(state),
                                     std::move(ctx));
}

actor_state role_state_snapshot(const role_handle& h, role_actor_state& s, std::uint64_t mailbox) {
  actor_state a;
  a.name = h.name;
  a.role = h.role;
  a.rank = h.rank;
  {
    std::lock_guard<std::mutex> lock(s.mu);
    a.activity = s.activity;
    a.metrics = s.metrics;
    a.mesh = s.mesh;
    a.history.assign(s.history.begin(), s.history.end());
  }
  a.mailbox_depth = mailbox;
  a.messages_received = s.msgs_in.load();
  a.messages_sent = s.msgs_out.load();
  a.bytes_received = s.bytes_in.load();
  a.bytes_sent = s.bytes_out.load();
  a.uptime_s = std::chrono::duration<double>(steady::now() - s.born).count();
  a.collectives = s.watched->records();
  return a;
}

// -- watched communicators
// ----------------------------------------------------------------------------------

namespace detail {

std::uint64_t watch_list::add(collective::communicator& c) {
  entry e;
  e.comm = &c;
  e.name = c.name();
  e.origin = steady::now();
  std::lock_guard<std::mutex> lock(mu_);
  const std::uint64_t id = next_id_++;
  entries_[id] = std::move(e);
  return id;
}

void watch_list::remove(std::uint64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  entries_.erase(id);
}

std::vector<collective_op> watch_list::records() {
  std::vector<collective_op> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, e] : entries_) {
    const auto records = e.comm->recent();
    const auto now = steady::now();
    for (const auto& r : records) {
      const auto shown = std::chrono::duration_cast<steady::duration>(
          std::chrono::duration<double, std::micro>(std::max(r.start_us, r.end_us)));
      e.origin = std::min(e.origin, now - shown);
    }
    const double now_us = std::chrono::duration<double, std::micro>(now - e.origin).count();
    auto ops = select_records(e.name, records, now_us);
    out.insert(out.end(), std::make_move_iterator(ops.begin()), std::make_move_iterator(ops.end()));
  }
  return out;
}

std::vector<collective_op> select_records(const std::string& communicator,
                                          const std::vector<collective::flight_record>& records,
                                          double now_us, std::size_t keep) {
  auto unfinished = [](const collective::flight_record& r) {
    return r.state == "issued" || r.state == "running";
  };
  std::size_t last_finished = records.size();
  for (std::size_t i = records.size(); i-- > 0;)
    if (!unfinished(records[i])) {
      last_finished = i;
      break;
    }
  const std::size_t recent_from = records.size() > keep ? records.size() - keep : 0;
  std::vector<collective_op> out;
  for (std::size_t i = 0; i < records.size(); ++i) {
    const auto& r = records[i];
    if (i < recent_from && !unfinished(r) && i != last_finished) continue;
    collective_op op;
    op.communicator = communicator;
    op.seq = r.seq;
    op.op = collective::op_kind_name(r.kind);
    op.dtype = std::string(dtype_name(r.type));
    op.count = r.count;
    op.peer = r.peer;
    op.state = r.state;
    op.start_us = r.start_us;
    op.end_us = r.end_us;
    op.age_s = std::max(0.0, (now_us - r.start_us) * 1e-6);
    out.push_back(std::move(op));
  }
  return out;
}

}  // namespace detail

collective_watch& collective_watch::operator=(collective_watch&& o) noexcept {
  if (this != &o) {
    unwatch();
    list_ = std::move(o.list_);
    id_ = o.id_;
    o.id_ = 0;
  }
  return *this;
}

void collective_watch::unwatch() noexcept {
  if (id_ == 0) return;
  if (auto l = list_.lock()) l->remove(id_);
  list_.reset();
  id_ = 0;
}

// -- role_context
// ----------------------------------------------------------------------------------

role_context::role_context(actors::node& n, role_handle self,
                           std::shared_ptr<role_actor_state> state)
    : node_(n), self_(std::move(self)), state_(std::move(state)) {}

void role_context::set_activity(const std::string& activity) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->activity = activity;
}
void role_context::set_metric(const std::string& key, double value) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->metrics[key] = value;
}
void role_context::record_step(std::int64_t step, const std::map<std::string, double>& values) {
  std::lock_guard<std::mutex> lock(state_->mu);
  for (const auto& [k, v] : values) state_->metrics[k] = v;
  state_->metrics["step"] = static_cast<double>(step);
  step_sample h;
  h.step = step;
  h.uptime_s = std::chrono::duration<double>(steady::now() - state_->born).count();
  h.values = values;
  auto& hist = state_->history;
  auto& stride = state_->history_stride;
  if (state_->history_tail) hist.pop_back();        // the previous latest, off the grid
  if (!hist.empty() && step <= hist.back().step) {  // a new run (resumed or restarted): start over
    hist.clear();
    stride = 1;
  }
  const std::int64_t first = hist.empty() ? step : hist.front().step;
  const auto on_grid = [&](std::int64_t s) { return (s - first) % stride == 0; };
  state_->history_tail = !on_grid(step);
  hist.push_back(std::move(h));
  while (hist.size() > step_history_limit) {  // thin to every other grid step
    stride *= 2;
    std::deque<step_sample> kept;
    for (std::size_t i = 0; i < hist.size(); ++i)
      if (on_grid(hist[i].step) || i + 1 == hist.size())  // the latest stays
        kept.push_back(std::move(hist[i]));
    hist = std::move(kept);
    state_->history_tail = !on_grid(step);
  }
}
void role_context::set_mesh(const std::string& axis, int coordinate) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->mesh[axis] = coordinate;
}
collective_watch role_context::watch(collective::communicator& c) {
  return collective_watch(state_->watched, state_->watched->add(c));
}

received_tensor role_context::receive(const tensor_info& info, std::chrono::milliseconds timeout) {
  auto r = node_.receive(info, timeout);
  state_->bytes_in += info.bytes;
  return r;
}
void role_context::receive(const tensor_info& info, void* dst, std::size_t bytes,
                           std::chrono::milliseconds timeout) {
  node_.receive(info, dst, bytes, timeout);
  state_->bytes_in += bytes;
}
tensor_send role_context::send_tensor(const role_handle& dest, const void* data, dtype type,
                                      std::span<const std::int64_t> shape,
                                      const std::string& name) {
  // It would wait for itself: its tensor handler cannot run while this handler does.
  TROUPE_CHECK(dest.rank != self_.rank || dest.channel != self_.channel, self_.name,
               " cannot send a tensor to itself");
  auto s = node_.send_tensor(dest, data, type, shape, name);
  ++state_->msgs_out;
  state_->bytes_out += s.info().bytes;
  return s;
}
tensor_send role_context::send_tensor(int dest, const void* data, dtype type,
                                      std::span<const std::int64_t> shape,
                                      const std::string& name) {
  auto s = node_.send_tensor(dest, data, type, shape, name);
  ++state_->msgs_out;
  state_->bytes_out += s.info().bytes;
  return s;
}

// -- role_registry
// ---------------------------------------------------------------------------------

role_registry& role_registry::add(const std::string& role, factory f) {
  TROUPE_CHECK(!role.empty(), "role_registry::add: empty role name");
  TROUPE_CHECK(f, "role_registry::add(\"", role, "\"): empty factory");
  TROUPE_CHECK(!roles_.count(role), "role_registry::add: role \"", role,
               "\" is already registered");
  roles_[role] = std::move(f);
  return *this;
}

const role_registry::factory* role_registry::find(const std::string& role) const {
  auto it = roles_.find(role);
  return it == roles_.end() ? nullptr : &it->second;
}

std::vector<std::string> role_registry::names() const {
  std::vector<std::string> out;
  for (const auto& [n, f] : roles_) out.push_back(n);
  return out;
}

// -- job
// -------------------------------------------------------------------------------------------

struct job::impl {
  node::impl* n = nullptr;
  std::unique_ptr<caf::scoped_actor> self;
  // (rank, channel) -> the actor and the incarnation of its rank when it was found.
  std::map<std::pair<int, std::uint16_t>, std::pair<caf::actor, std::uint32_t>> actors;

  std::uint32_t incarnation(int rank) {
    std::lock_guard<std::mutex> lock(n->mu);
    return rank >= 0 && rank < static_cast<int>(n->incarnation.size()) ? n->incarnation[rank] : 0;
  }
  std::uint64_t next_corr = 1;

  std::string who(const role_handle& h) const {
    return h.name + " (rank " + std::to_string(h.rank) + ")";
  }

  // The actor behind a handle: known from spawn, else looked up on its node.
  caf::actor resolve(const role_handle& h, ms timeout) {
    auto key = std::make_pair(h.rank, h.channel);
    const std::uint32_t inc = incarnation(h.rank);
    if (auto it = actors.find(key); it != actors.end() && it->second.second == inc)
      return it->second.first;
    TROUPE_CHECK(h.valid(), "job: invalid role handle \"", h.name, "\"");
    caf::actor node_actor = n->peer(h.rank);
    msg::spawn_reply rep;
    std::string failure;
    (*self)
        ->request(node_actor, timeout, msg::lookup_request{h.channel})
        .receive([&](msg::spawn_reply& r) { rep = std::move(r); },
                 [&](caf::error& e) { failure = n->sys->render(e); });
    if (!failure.empty()) TROUPE_FAIL("job: looking up ", who(h), " failed: ", failure);
    if (!rep.ok) TROUPE_FAIL("job: looking up ", who(h), ": ", rep.error);
    actors[key] = {rep.actor, inc};
    return rep.actor;
  }

  std::string lost_text(int rank) {
    std::lock_guard<std::mutex> lock(n->mu);
    return n->failure_of(rank);
  }
};

job::job(actors::node& nd) : impl_(std::make_unique<impl>()) {
  impl_->n = &nd.internals();
  TROUPE_CHECK(impl_->n->sys, "job: the node is shut down");
  impl_->self = std::make_unique<caf::scoped_actor>(*impl_->n->sys);
  ++impl_->n->live_jobs;
}

job::~job() {
  impl_->self.reset();
  --impl_->n->live_jobs;
}

role_handle job::spawn(const std::string& role, int rank, const std::string& name,
                       std::chrono::milliseconds timeout) {
  auto& I = *impl_;
  TROUPE_CHECK(rank >= 0 && rank < I.n->world, "job: spawn \"", role, "\" on rank ", rank,
               ": the world has ", I.n->world, " ranks");
  if (auto f = I.lost_text(rank); !f.empty())
    TROUPE_FAIL("job: spawn \"", role, "\" on rank ", rank, ": ", f);
  caf::actor node_actor = I.n->peer(rank);
  msg::spawn_reply rep;
  std::string failure;
  (*I.self)
      ->request(node_actor, timeout, msg::spawn_request{role, name})
      .receive([&](msg::spawn_reply& r) { rep = std::move(r); },
               [&](caf::error& e) { failure = I.n->sys->render(e); });
  if (!failure.empty()) {
    const auto lost = I.lost_text(rank);
    TROUPE_FAIL("job: spawn \"", role, "\" on rank ", rank,
                " failed: ", lost.empty() ? failure : lost);
  }
  if (!rep.ok) TROUPE_FAIL("job: spawn \"", role, "\" on rank ", rank, ": ", rep.error);
  role_handle h;
  h.name = rep.name;
  h.role = rep.role;
  h.rank = rank;
  h.channel = rep.channel;
  I.actors[{rank, rep.channel}] = {rep.actor, I.incarnation(rank)};
  return h;
}

std::vector<role_handle> job::spawn_on_all(const std::string& role,
                                           std::chrono::milliseconds timeout) {
  std::vector<role_handle> out;
  for (int r : impl_->n->owner.alive()) out.push_back(spawn(role, r, {}, timeout));
  return out;
}

void job::stop(const role_handle& h) {
  auto& I = *impl_;
  if (!h.valid() || !I.lost_text(h.rank).empty()) return;
  caf::actor node_actor = I.n->peer(h.rank);
  caf::send_as(I.n->node_actor, node_actor, msg::stop_request{h.channel});
  I.actors.erase({h.rank, h.channel});
}

std::vector<job::raw_reply> job::ask_raw(std::span<const role_handle> handles,
                                         const std::string& kind, const bytes& payload,
                                         const std::string& reply_kind,
                                         std::chrono::milliseconds timeout, bool throw_on_error) {
  auto& I = *impl_;
  const auto deadline = steady::now() + timeout;
  std::vector<raw_reply> out(handles.size());
  std::map<std::uint64_t, std::size_t> waiting;  // corr -> index
  for (std::size_t i = 0; i < handles.size(); ++i) {
    const auto& h = handles[i];
    if (auto f = I.lost_text(h.rank); !f.empty()) {
      out[i].error = I.who(h) + ": " + f;
      continue;
    }
    try {
      caf::actor a = I.resolve(h, timeout);
      const std::uint64_t corr = I.next_corr++;
      (*I.self)->send(a, msg::role_request{corr, kind, payload});
      waiting[corr] = i;
    } catch (const std::exception& e) {
      out[i].error = e.what();
    }
  }
  // Gather, checking membership every slice so a lost rank fails its ask at once. When throwing,
  // the first error ends the wait: the others may be blocked on the failed actor (a collective
  // it left), and its error is the cause worth reporting.
  const ms slice(20);
  bool failed_one = false;
  while (!waiting.empty() && !(throw_on_error && failed_one)) {
    const auto now = steady::now();
    if (timeout.count() > 0 && now >= deadline) break;
    auto wait = slice;
    if (timeout.count() > 0)
      wait = std::min(wait, std::chrono::duration_cast<ms>(deadline - now) + ms(1));
    (*I.self)->receive(
        [&](msg::role_reply& r) {
          auto it = waiting.find(r.corr);
          if (it == waiting.end()) return;  // a late reply to an earlier ask
          auto& o = out[it->second];
          const auto& h = handles[it->second];
          if (!r.ok) {
            o.error = r.error;
            failed_one = true;
          } else if (r.kind != reply_kind)
            o.error = I.who(h) + " answered with a reply of kind \"" + r.kind +
                      "\", the asker expects \"" + reply_kind + "\"";
          else
            o.payload = std::move(r.payload);
          waiting.erase(it);
        },
        caf::after(wait) >> [] {});
    for (auto it = waiting.begin(); it != waiting.end();) {
      const auto& h = handles[it->second];
      if (auto f = I.lost_text(h.rank); !f.empty()) {
        out[it->second].error = I.who(h) + ": " + f;
        failed_one = true;
        it = waiting.erase(it);
      } else {
        ++it;
      }
    }
  }
  std::vector<bool> abandoned(handles.size(), false);
  for (const auto& [corr, i] : waiting) {
    abandoned[i] = failed_one;
    out[i].error = failed_one ? I.who(handles[i]) + ": no reply to \"" + kind +
                                    "\" yet (stopped waiting after the errors before)"
                              : I.who(handles[i]) + ": no reply to \"" + kind + "\" within " +
                                    std::to_string(timeout.count()) + " ms";
  }
  if (throw_on_error) {
    std::string errors;
    int failed = 0;
    for (bool second : {false, true})  // the causes first, then the asks abandoned after them
      for (std::size_t i = 0; i < out.size(); ++i)
        if (!out[i].error.empty() && abandoned[i] == second) {
          errors += (errors.empty() ? "" : "; ") + out[i].error;
          ++failed;
        }
    if (failed == 1 && handles.size() == 1) TROUPE_FAIL("ask: ", errors);
    if (failed > 0)
      TROUPE_FAIL("ask_all: ", failed, " of ", handles.size(), " actors failed: ", errors);
  }
  return out;
}

}  // namespace troupe::actors
