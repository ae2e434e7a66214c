// The tier-manager role actor (see tier_actor.hpp).
#include "actors/tier_actor.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>

#include "actors/nvme_actor.hpp"
#include "memory/error.hpp"

namespace troupe::actors {

std::map<std::string, double> tier_metrics(const memory::tier_report& r) {
  auto d = [](auto v) { return static_cast<double>(v); };
  return {{"tier.device_bytes", d(r.device_used)},
          {"tier.device_budget", d(r.device_budget)},
          {"tier.device_peak", d(r.device_peak)},
          {"tier.host_bytes", d(r.host_used)},
          {"tier.host_budget", d(r.host_budget)},
          {"tier.nvme_bytes", d(r.nvme_bytes)},
          {"tier.chunks", d(r.chunks)},
          {"tier.chunks_device", d(r.chunks_device)},
          {"tier.chunks_host", d(r.chunks_host)},
          {"tier.chunks_nvme", d(r.chunks_nvme)},
          {"tier.in_flight", d(r.in_flight)},
          {"tier.prefetch_hit_rate", r.hit_rate()},
          {"tier.prefetches", d(r.prefetches)},
          {"tier.evictions", d(r.evictions)},
          {"tier.io_gbps", r.io_gbps()},
          {"tier.nvme_read_gb", d(r.nvme_read_bytes) / 1e9},
          {"tier.nvme_write_gb", d(r.nvme_write_bytes) / 1e9}};
}

namespace {

void publish(role_context& c, tier_session& s) {
  for (const auto& [k, v] : tier_metrics(s.report())) c.set_metric(k, v);
}

// The NVMe actor of one session: spawned on the tier actor's rank, stopped with the session.
struct nvme_tier {
  node* host = nullptr;
  role_handle handle;
  tier_resources resources;

  nvme_tier(role_context& c, const std::string& dir) : host(&c.node()) {
    job j(c.node());
    handle = j.spawn(nvme_role, c.rank(), c.name() + ".nvme");
    try {
      nvme_open open;
      open.dir = dir;
      // A name of its own per session: a replaced session's store may still be closing.
      static std::atomic<std::uint64_t> sessions{0};
      open.name = "troupe_tiers." + std::to_string(::getpid()) + "." + c.name() + "." +
                  std::to_string(sessions++);
      j.ask<std::string>(handle, open);
      resources.nvme = nvme_client(c.node(), handle);
      resources.nvme_actor = handle.name;
    } catch (...) {
      j.stop(handle);
      throw;
    }
  }
  ~nvme_tier() {
    resources.nvme.reset();
    try {
      job j(*host);
      j.stop(handle);
    } catch (const std::exception&) {  // the node is shut down: it stopped the actor itself
    }
  }
};

}  // namespace

void add_tier_manager_role(role_registry& roles, tier_session_factory make) {
  add_nvme_role(roles);
  roles.add(tier_manager_role, [make](role_builder& b, role_context&) {
    struct state {
      std::mutex mu;
      std::unique_ptr<nvme_tier> nvme;  // before the session: destroyed after it
      std::unique_ptr<tier_session> session;
      std::int64_t steps = 0;
      void reset() {
        session.reset();
        nvme.reset();
      }
    };
    auto st = std::make_shared<state>();
    b.on<tier_setup>([st, make](role_context& c, const tier_setup& s) {
      std::lock_guard<std::mutex> lock(st->mu);
      c.set_activity("setting up " + s.model);
      st->reset();
      tier_resources res;
      if (!s.nvme_dir.empty()) {
        st->nvme = std::make_unique<nvme_tier>(c, s.nvme_dir);
        res = st->nvme->resources;
      }
      st->session = make(s, res);
      TROUPE_CHECK(st->session != nullptr, c.name(), ": the tier session factory made nothing");
      st->steps = 0;
      publish(c, *st->session);
      c.set_activity("idle");
      return st->session->describe();
    });
    b.on<tier_step>([st](role_context& c, const tier_step& r) {
      std::lock_guard<std::mutex> lock(st->mu);
      TROUPE_CHECK(st->session != nullptr, c.name(), ": tier_step before tier_setup");
      tier_step_reply out;
      const auto t0 = std::chrono::steady_clock::now();
      for (std::int64_t i = 0; i < r.steps; ++i) {
        c.set_activity("step " + std::to_string(st->steps + 1));
        out.losses.push_back(st->session->step());
        ++st->steps;
        publish(c, *st->session);
        // The dashboard's series: the loss and the bytes of each tier the chunks live in.
        const auto rep = st->session->report();
        c.record_step(st->steps, {{"loss", out.losses.back()},
                                  {"memory.device_bytes", static_cast<double>(rep.device_used)},
                                  {"memory.host_bytes", static_cast<double>(rep.host_used)},
                                  {"memory.nvme_bytes", static_cast<double>(rep.nvme_bytes)}});
      }
      out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      c.set_activity("idle");
      return out;
    });
    b.on<tier_numbers_request>([st](role_context& c, const tier_numbers_request&) {
      std::lock_guard<std::mutex> lock(st->mu);
      TROUPE_CHECK(st->session != nullptr, c.name(), ": tier_numbers_request before tier_setup");
      return tier_metrics(st->session->report());
    });
    b.on_stop([st](role_context&) {
      std::lock_guard<std::mutex> lock(st->mu);
      st->reset();
    });
  });
}

}  // namespace troupe::actors
