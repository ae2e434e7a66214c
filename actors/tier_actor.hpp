// tier_actor: the "tier-manager" role actor. It owns a tier session (what the composition root's
// factory makes from a tier_setup request: in `troupe bench offload`, an offloaded trainer whose
// chunks live under a memory::tier_manager), runs its steps when asked, and publishes the tier
// manager's numbers as its actor_state metrics after each step (bytes per tier, chunks per tier,
// chunks in flight, prefetch hit rate, I/O GB/s), so `describe`, `troupe ps` and `troupe top` show
// them. The actor holds no maths: the session does the work; the actor sequences it.
//
// The NVMe tier: when tier_setup names an nvme_dir, the actor spawns an "nvme" role actor
// (actors/nvme_actor.hpp) on its rank, named "<its name>.nvme", opens its store in that directory
// and hands the session its client (tier_resources::nvme), which the session passes to its
// tier_manager (tier_manager_options::nvme_io): the pages then move through the NVMe actor, whose
// numbers `troupe ps` shows next to the tier manager's. The NVMe actor stops with the session.
//
//   role_registry roles;
//   add_tier_manager_role(roles, [](const tier_setup& s, const tier_resources& r) {
//     return make_my_session(s, r.nvme);
//   });
//   auto tm = job.spawn(tier_manager_role, 0);
//   job.ask<std::string>(tm, tier_setup{...});             // builds the session
//   auto r = job.ask<tier_step_reply>(tm, tier_step{5});   // 5 steps, their losses
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "actors/roles.hpp"
#include "memory/io/page_io.hpp"
#include "memory/tier_manager.hpp"

namespace troupe::actors {

inline constexpr const char* tier_manager_role = "tier-manager";

// What to build. Interpreted by the session factory; the fields name a tiny GPT and the tiers.
struct tier_setup {
  std::string model = "gpt2-demo";  // a named size (models::named_model_config)
  std::int64_t n_layer = 0;         // 0: the named size's
  std::int64_t batch = 2, seq = 32;
  std::uint64_t device_bytes = 0, host_bytes = 0;
  std::string nvme_dir;
  std::string placement = "automatic";  // "automatic" or "fixed"
  double param_fraction = 1, optim_fraction = 1;
  std::string param_tier = "host", optim_tier = "host";  // "host" or "nvme"
  auto fields() {
    return std::tie(model, n_layer, batch, seq, device_bytes, host_bytes, nvme_dir, placement,
                    param_fraction, optim_fraction, param_tier, optim_tier);
  }
};
// Reply to tier_setup: a one-line description of the session (chunk size, homes).

struct tier_step {
  std::int64_t steps = 1;
};
struct tier_step_reply {
  std::vector<double> losses;
  double seconds = 0;  // wall time of the steps
  auto fields() { return std::tie(losses, seconds); }
};
// Asks for the current numbers; the reply is tier_metrics(report) (std::map<string, double>).
struct tier_numbers_request {
  std::uint8_t unused = 0;
};

// What the actor provides to the session it makes.
struct tier_resources {
  std::shared_ptr<memory::io::page_io> nvme;  // the NVMe actor's client (null: no nvme_dir)
  std::string nvme_actor;                     // its name in the job ("" without)
};

// What the actor drives.
class tier_session {
 public:
  virtual ~tier_session() = default;
  virtual std::string describe() = 0;  // the reply to tier_setup
  virtual double step() = 0;           // one training step; returns its loss
  virtual memory::tier_report report() = 0;
};
using tier_session_factory =
    std::function<std::unique_ptr<tier_session>(const tier_setup&, const tier_resources&)>;

// The metrics of a tier report, keyed "tier.<name>": device_bytes, device_budget, device_peak,
// host_bytes, host_budget, nvme_bytes, chunks, chunks_device, chunks_host, chunks_nvme,
// in_flight, prefetch_hit_rate, prefetches, evictions, io_gbps, nvme_read_gb, nvme_write_gb.
std::map<std::string, double> tier_metrics(const memory::tier_report& r);

// Registers the "tier-manager" role: tier_setup (makes the session; again: replaces it),
// tier_step and tier_numbers_request; and the "nvme" role it spawns, unless registered already.
void add_tier_manager_role(role_registry& roles, tier_session_factory make);

}  // namespace troupe::actors
