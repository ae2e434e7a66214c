// The NVMe actor (see nvme_actor.hpp): a detached CAF actor over an nvme_store, its reaper
// thread, the page_io client over CAF messages, and the "nvme" role around it.
//
// Messages (local only: pointers travel as integers):
//   client -> forwarder: (op, id, key, ptr, n)    forwarder -> actor: request (op, key, ptr, n)
//   actor -> forwarder: bytes or error            reaper -> actor: reaped
#include "actors/nvme_actor.hpp"

#include <caf/all.hpp>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "actors/caf_system.hpp"
#include "actors/node_impl.hpp"
#include "memory/error.hpp"

namespace troupe::actors {

namespace io = memory::io;

namespace {

using write_atom = caf::atom_constant<caf::atom("nvme_write")>;
using read_atom = caf::atom_constant<caf::atom("nvme_read")>;
using remove_atom = caf::atom_constant<caf::atom("nvme_rm")>;
using reaped_atom = caf::atom_constant<caf::atom("nvme_reap")>;
using stop_atom = caf::atom_constant<caf::atom("nvme_stop")>;

std::uint64_t as_int(const void* p) {
  return static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(p));
}

caf::error store_error(const std::string& what) {
  return caf::make_error(caf::sec::runtime_error, what);
}

// The store's message carried by a CAF error, else CAF's rendering of it.
std::string error_text(caf::actor_system& sys, const caf::error& e) {
  const caf::message& ctx = e.context();
  if (e.category() == caf::atom("system") &&
      e.code() == static_cast<std::uint8_t>(caf::sec::runtime_error) &&
      ctx.match_elements<std::string>())
    return ctx.get_as<std::string>(0);
  return "the nvme actor did not answer: " + sys.render(e);
}

}  // namespace

struct nvme_actor::impl {
  // Declared first, destroyed last: an actor system of its own (standalone use).
  std::unique_ptr<caf::actor_system_config> own_cfg;
  std::unique_ptr<caf::actor_system> own_sys;
  caf::actor_system* sys = nullptr;
  std::unique_ptr<io::nvme_store> store;
  caf::actor server;

  // The reaper thread: woken when requests are issued, sleeps in the kernel until they complete.
  std::mutex mu;
  std::condition_variable cv;
  bool issued = false, stop = false;
  std::thread reaper;

  mutable std::mutex metrics_mu;
  std::function<void(const std::map<std::string, double>&)> on_metrics;

  void note_issued() {
    {
      std::lock_guard<std::mutex> lock(mu);
      issued = true;
    }
    cv.notify_one();
  }

  void reap_loop() {
    std::uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || issued; });
        if (stop) return;
        issued = false;
      }
      for (;;) {
        std::uint64_t now = seen;
        try {
          now = store->wait_progress(seen);
        } catch (const std::exception& e) {  // the ring failed: requests stay unanswered
          std::fprintf(stderr, "troupe: nvme actor on %s: %s\n", store->path().c_str(), e.what());
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        if (now != seen) {
          seen = now;
          caf::anon_send(server, reaped_atom::value);
        }
        if (store->in_flight() == 0) break;
      }
    }
  }

  std::map<std::string, double> metrics(std::size_t in_flight) const {
    const io::nvme_stats s = store->stats();
    auto d = [](auto v) { return static_cast<double>(v); };
    return {{"nvme.bytes_read", d(s.bytes_read)},
            {"nvme.bytes_written", d(s.bytes_written)},
            {"nvme.in_flight", d(in_flight)},
            {"nvme.read_gbps", s.read_gbps()},
            {"nvme.write_gbps", s.write_gbps()},
            {"nvme.io_uring", store->backend() == io::io_backend::io_uring ? 1.0 : 0.0},
            {"nvme.o_direct", store->direct_io() ? 1.0 : 0.0},
            {"nvme.failed", d(s.failed)},
            {"nvme.checksum_errors", d(s.checksum_errors)},
            {"nvme.used_bytes", d(store->used_bytes())}};
  }

  void publish(std::size_t in_flight) {
    std::lock_guard<std::mutex> lock(metrics_mu);
    if (on_metrics) on_metrics(metrics(in_flight));
  }

  void start(io::nvme_store_options o);
  void shutdown() noexcept;
};

namespace {

struct server_state {
  struct request {
    io::io_ticket ticket;
    caf::typed_response_promise<std::uint64_t> rp;
    std::uint64_t bytes = 0;
  };
  nvme_actor::impl* core = nullptr;
  std::unordered_map<std::uint64_t, request> pending;
  std::uint64_t next = 1;
  static inline const char* name = "troupe_nvme";
};
using server_t = caf::stateful_actor<server_state>;

// Answers every request whose I/O is done. The metrics are published first, so a client that
// sees its answer finds the request counted.
void answer_done(server_t* self) {
  auto& st = self->state;
  struct answer {
    caf::typed_response_promise<std::uint64_t> rp;
    std::uint64_t bytes = 0;
    std::string error;
  };
  std::vector<answer> done;
  for (auto it = st.pending.begin(); it != st.pending.end();) {
    if (!it->second.ticket.test()) {
      ++it;
      continue;
    }
    answer a{it->second.rp, it->second.bytes, {}};
    try {
      it->second.ticket.wait();
    } catch (const std::exception& e) {
      a.error = e.what();
    }
    done.push_back(std::move(a));
    it = st.pending.erase(it);
  }
  st.core->publish(st.pending.size());
  for (auto& a : done) {
    if (a.error.empty())
      a.rp.deliver(a.bytes);
    else
      a.rp.deliver(store_error(a.error));
  }
}

template <class Issue>
caf::result<std::uint64_t> issue(server_t* self, std::uint64_t bytes, Issue make) {
  auto& st = self->state;
  io::io_ticket t;
  try {
    t = make();
  } catch (const std::exception& e) {  // refused at issue (an empty page, a null buffer)
    return store_error(e.what());
  }
  auto rp = self->make_response_promise<std::uint64_t>();
  st.pending.emplace(st.next++, server_state::request{std::move(t), rp, bytes});
  st.core->note_issued();
  answer_done(self);  // the pread backend finished it already
  return rp;
}

caf::behavior nvme_server(server_t* self, nvme_actor::impl* core) {
  self->state.core = core;
  auto& store = *core->store;
  return {
      [self, &store](write_atom, std::uint64_t key, std::uint64_t p, std::uint64_t n) {
        return issue(self, n, [&] {
          return store.write(key, reinterpret_cast<const void*>(static_cast<std::uintptr_t>(p)), n);
        });
      },
      [self, &store](read_atom, std::uint64_t key, std::uint64_t p, std::uint64_t n) {
        return issue(self, n, [&] {
          return store.read(key, reinterpret_cast<void*>(static_cast<std::uintptr_t>(p)), n);
        });
      },
      [self, &store](remove_atom, std::uint64_t key) -> caf::result<std::uint64_t> {
        try {
          store.erase(key);  // waits for this key's requests (issued already)
        } catch (const std::exception& e) {
          return store_error(e.what());
        }
        answer_done(self);
        return std::uint64_t{0};
      },
      [self](reaped_atom) { answer_done(self); },
      [self, &store](stop_atom) {  // requests after this one are bounced by CAF
        store.wait_all();
        answer_done(self);
        self->quit();
      },
  };
}

}  // namespace

void nvme_actor::impl::start(io::nvme_store_options o) {
  store = std::make_unique<io::nvme_store>(std::move(o));
  server = sys->spawn<caf::detached>(nvme_server, this);
  reaper = std::thread([this] { reap_loop(); });
}

void nvme_actor::impl::shutdown() noexcept {
  if (!server) return;
  {
    caf::scoped_actor self{*sys};
    self->send(server, stop_atom::value);  // it answers what it has issued, then quits
    self->wait_for(server);
  }
  {
    std::lock_guard<std::mutex> lock(mu);
    stop = true;
  }
  cv.notify_one();
  reaper.join();
  server = nullptr;
  store.reset();
}

nvme_actor::nvme_actor(node& n, io::nvme_store_options o) : impl_(std::make_shared<impl>()) {
  impl_->sys = n.internals().sys.get();
  impl_->start(std::move(o));
}

nvme_actor::nvme_actor(io::nvme_store_options o) : impl_(std::make_shared<impl>()) {
  impl_->own_cfg = detail::make_caf_config(1);
  impl_->own_sys = std::make_unique<caf::actor_system>(*impl_->own_cfg);
  impl_->sys = impl_->own_sys.get();
  impl_->start(std::move(o));
}

nvme_actor::~nvme_actor() {
  impl_->shutdown();
}

std::map<std::string, double> nvme_actor::metrics() const {
  return impl_->metrics(impl_->store->in_flight());
}

std::string nvme_actor::describe() const {
  return impl_->store->describe_backend();
}

const io::nvme_store& nvme_actor::store() const {
  return *impl_->store;
}

void nvme_actor::register_buffer(void* p, std::size_t n) {
  impl_->store->register_buffer(p, n);
}

void nvme_actor::unregister_buffer(void* p) {
  impl_->store->unregister_buffer(p);
}

void nvme_actor::on_metrics(std::function<void(const std::map<std::string, double>&)> f) {
  std::lock_guard<std::mutex> lock(impl_->metrics_mu);
  impl_->on_metrics = std::move(f);
}

// ---------------------------------------------------------------- the client

namespace {

// Completions of one client's requests, by ticket id.
struct completions {
  std::mutex mu;
  std::condition_variable cv;
  struct entry {
    bool done = false;
    std::string error;
  };
  std::unordered_map<std::uint64_t, entry> by_id;
  std::uint64_t next = 1;

  void complete(std::uint64_t id, std::string error) {
    {
      std::lock_guard<std::mutex> lock(mu);
      auto& e = by_id[id];
      e.done = true;
      e.error = std::move(error);
    }
    cv.notify_all();
  }
};

// Forwards a client's requests to the actor as CAF requests and records their answers.
caf::behavior forwarder(caf::event_based_actor* self, caf::actor server,
                        std::shared_ptr<completions> c) {
  auto* sys = &self->system();
  auto ask = [=](auto op, std::uint64_t id, auto... args) {
    self->request(server, caf::infinite, op, args...)
        .then([c, id](std::uint64_t) { c->complete(id, ""); },
              [c, id, sys](caf::error& e) { c->complete(id, error_text(*sys, e)); });
  };
  return {
      [ask](write_atom op, std::uint64_t id, std::uint64_t key, std::uint64_t p, std::uint64_t n) {
        ask(op, id, key, p, n);
      },
      [ask](read_atom op, std::uint64_t id, std::uint64_t key, std::uint64_t p, std::uint64_t n) {
        ask(op, id, key, p, n);
      },
      [ask](remove_atom op, std::uint64_t id, std::uint64_t key) { ask(op, id, key); },
  };
}

class actor_page_io final : public io::page_io {
 public:
  explicit actor_page_io(std::shared_ptr<nvme_actor::impl> core)
      : core_(std::move(core)), c_(std::make_shared<completions>()) {
    TROUPE_CHECK(core_->server, "nvme actor client: the actor is stopped");
    proxy_ = core_->sys->spawn(forwarder, core_->server, c_);
    path_ = core_->store->path();
  }
  ~actor_page_io() override {
    wait_all();
    caf::anon_send_exit(proxy_, caf::exit_reason::user_shutdown);
  }

  io::io_ticket write(std::uint64_t key, const void* p, std::size_t n) override {
    const std::uint64_t id = open_id();
    caf::anon_send(proxy_, write_atom::value, id, key, as_int(p), std::uint64_t{n});
    return make_ticket(id);
  }
  io::io_ticket read(std::uint64_t key, void* p, std::size_t n) override {
    const std::uint64_t id = open_id();
    caf::anon_send(proxy_, read_atom::value, id, key, as_int(p), std::uint64_t{n});
    return make_ticket(id);
  }
  void remove(std::uint64_t key) override {
    const std::uint64_t id = open_id();
    caf::anon_send(proxy_, remove_atom::value, id, key);
    ticket_wait(id);
  }
  void wait_all() override {
    std::unique_lock<std::mutex> lock(c_->mu);
    c_->cv.wait(lock, [&] {
      for (const auto& [id, e] : c_->by_id)
        if (!e.done) return false;
      return true;
    });
  }

  std::uint64_t used_bytes() const override { return store().used_bytes(); }
  io::nvme_stats stats() const override { return store().stats(); }
  void reset_stats() override { store().reset_stats(); }
  io::io_backend backend() const override { return store().backend(); }
  bool direct_io() const override { return store().direct_io(); }
  std::string path() const override { return path_; }
  std::string backend_note() const override { return store().backend_note(); }

 private:
  io::nvme_store& store() const {
    TROUPE_CHECK(core_->store, "nvme actor client of ", path_, ": the actor is stopped");
    return *core_->store;
  }
  std::uint64_t open_id() {
    std::lock_guard<std::mutex> lock(c_->mu);
    const std::uint64_t id = c_->next++;
    c_->by_id[id];
    return id;
  }
  void ticket_wait(std::uint64_t id) override {
    std::unique_lock<std::mutex> lock(c_->mu);
    c_->cv.wait(lock, [&] { return c_->by_id.at(id).done; });
    std::string err = std::move(c_->by_id.at(id).error);
    c_->by_id.erase(id);
    if (!err.empty()) throw error(err);
  }
  bool ticket_test(std::uint64_t id) override {
    std::lock_guard<std::mutex> lock(c_->mu);
    return c_->by_id.at(id).done;
  }
  void ticket_release(std::uint64_t id) noexcept override {
    std::unique_lock<std::mutex> lock(c_->mu);
    c_->cv.wait(lock, [&] { return c_->by_id.at(id).done; });
    c_->by_id.erase(id);
  }

  std::shared_ptr<nvme_actor::impl> core_;
  std::shared_ptr<completions> c_;
  caf::actor proxy_;
  std::string path_;
};

}  // namespace

std::shared_ptr<io::page_io> nvme_actor::client() {
  return std::make_shared<actor_page_io>(impl_);
}

// ---------------------------------------------------------------- the "nvme" role

namespace {

// The opened nvme actors of this process's roles, by (node, actor name).
std::mutex registry_mu;
std::map<std::pair<const node*, std::string>, std::weak_ptr<nvme_actor>> registry;

io::nvme_store_options store_options(const nvme_open& r) {
  io::nvme_store_options o;
  o.dir = r.dir;
  o.name = r.name;
  o.queue_depth = static_cast<unsigned>(r.queue_depth);
  o.capacity_bytes = r.capacity_bytes;
  if (r.backend == "pread")
    o.backend = io::io_backend::pread;
  else if (r.backend == "io_uring")
    o.backend = io::io_backend::io_uring;
  else
    TROUPE_CHECK(r.backend.empty(), "nvme_open: backend \"", r.backend,
                 "\" is not one of \"\", io_uring, pread");
  o.direct = r.direct;
  return o;
}

}  // namespace

void add_nvme_role(role_registry& roles) {
  if (roles.find(nvme_role)) return;
  roles.add(nvme_role, [](role_builder& b, role_context&) {
    struct state {
      std::mutex mu;
      std::shared_ptr<nvme_actor> actor;
    };
    auto st = std::make_shared<state>();
    auto drop = [st](role_context& c) {
      std::lock_guard<std::mutex> lock(st->mu);
      {
        std::lock_guard<std::mutex> r(registry_mu);
        registry.erase({&c.node(), c.name()});
      }
      st->actor.reset();
    };
    b.on<nvme_open>([st, drop](role_context& c, const nvme_open& r) {
      drop(c);
      std::lock_guard<std::mutex> lock(st->mu);
      c.set_activity("opening a store in " + r.dir);
      st->actor = std::make_shared<nvme_actor>(c.node(), store_options(r));
      const std::string what = st->actor->describe();
      c.set_activity(what);
      st->actor->on_metrics([&c](const std::map<std::string, double>& m) {
        for (const auto& [k, v] : m) c.set_metric(k, v);
      });
      for (const auto& [k, v] : st->actor->metrics()) c.set_metric(k, v);
      std::lock_guard<std::mutex> r2(registry_mu);
      registry[{&c.node(), c.name()}] = st->actor;
      return what;
    });
    b.on<nvme_numbers_request>([st](role_context& c, const nvme_numbers_request&) {
      std::lock_guard<std::mutex> lock(st->mu);
      TROUPE_CHECK(st->actor, c.name(), ": nvme_numbers_request before nvme_open");
      return st->actor->metrics();
    });
    b.on_stop(drop);
  });
}

std::shared_ptr<io::page_io> nvme_client(node& n, const role_handle& h) {
  TROUPE_CHECK(h.rank == n.rank(), "nvme_client: the nvme actor ", h.name, " runs on rank ", h.rank,
               ", not on this process's rank ", n.rank(), " (buffers travel as pointers)");
  std::shared_ptr<nvme_actor> a;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = registry.find({&n, h.name});
    if (it != registry.end()) a = it->second.lock();
  }
  TROUPE_CHECK(a, "nvme_client: no opened nvme actor named ", h.name, " on rank ", h.rank,
               " (send it nvme_open first)");
  return a->client();
}

}  // namespace troupe::actors
