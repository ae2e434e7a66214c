// troupe train with memory tiers (see apps/train_tiers.hpp).
#include <fmt/core.h>

#include <chrono>
#include <exception>
#include <memory>
#include <string>
#include <utility>
#include <variant>

#include "actors/bootstrap.hpp"
#include "actors/node.hpp"
#include "actors/roles.hpp"
#include "actors/tier_actor.hpp"
#include "apps/train_tiers.hpp"
#include "memory/error.hpp"
#include "models/data_source.hpp"
#include "models/families.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/offload/offload_trainer.hpp"
#include "models/run_state.hpp"
#include "models/train_loop.hpp"
#include "tensor/parallel.hpp"

namespace troupe::apps {
namespace {

using memory::tier;
using models::train_config;

double mib(double bytes) {
  return bytes / (1 << 20);
}

tier tier_of(const std::string& name, const train_config& c) {
  if (name.empty()) return c.mem_nvme_dir.empty() ? tier::host : tier::nvme;
  return name == "nvme" ? tier::nvme : tier::host;
}

models::offload_options options_of(const train_config& c) {
  models::offload_options o;
  o.device_bytes = c.mem_device;
  o.host_bytes = c.mem_host;
  o.nvme_dir = c.mem_nvme_dir;
  o.nvme_capacity_bytes = c.mem_nvme_capacity;
  auto& p = o.placement;
  const bool fixed =
      c.mem_offload == "fixed" ||
      (c.mem_offload.empty() && (c.mem_offload_params >= 0 || c.mem_offload_optimizer >= 0));
  p.how =
      fixed ? models::offload_placement::mode::fixed : models::offload_placement::mode::automatic;
  p.param_fraction = c.mem_offload_params >= 0 ? c.mem_offload_params : 0.0;
  p.optim_fraction = c.mem_offload_optimizer >= 0 ? c.mem_offload_optimizer : 1.0;
  p.param_tier = tier_of(c.mem_params_tier, c);
  p.optim_tier = tier_of(c.mem_optimizer_tier, c);
  return o;
}

std::string placement_line(models::offload_trainer& tr) {
  int p[3] = {0, 0, 0}, o[3] = {0, 0, 0};
  auto k = [](tier t) { return t == tier::device ? 0 : t == tier::host ? 1 : 2; };
  for (std::int32_t i = 0; i < tr.chunk_count(); ++i) {
    ++p[k(tr.param_home(i))];
    ++o[k(tr.optim_home(i))];
  }
  return fmt::format("parameter chunks device/host/nvme {}/{}/{}, optimizer-state chunks {}/{}/{}",
                     p[0], p[1], p[2], o[0], o[1], o[2]);
}

// The report line of the tiers' state.
std::string tiers_line(models::offload_trainer& tr) {
  const auto r = tr.tiers().report();
  const auto& l = tr.chunking().layout;
  return fmt::format(
      "tiers: device {:.1f} MiB (peak {:.1f} of {:.1f}), host {:.1f} MiB, nvme {:.1f} MiB; chunk "
      "{} KiB x {} (waste {:.1f}%); prefetch hit rate {:.2f}; NVMe read {:.1f} MiB write {:.1f} "
      "MiB, {:.2f} GB/s; non-model memory planned {:.1f} MiB{}",
      mib(r.device_used), mib(r.device_peak), mib(r.device_budget), mib(r.host_used),
      mib(r.nvme_bytes), l.chunk_bytes >> 10, l.chunks,
      100.0 * static_cast<double>(l.wasted_bytes()) / static_cast<double>(l.total_bytes()),
      r.hit_rate(), mib(r.nvme_read_bytes), mib(r.nvme_write_bytes), r.io_gbps(),
      mib(tr.non_model_bytes()),
      tr.measured_non_model_bytes() > 0
          ? fmt::format(", measured {:.1f} MiB", mib(tr.measured_non_model_bytes()))
          : std::string());
}

// What the tier-manager actor drives: the app's trainer, one step per tier_step.
// The launched run's session: owns the trainer, so the actor destroys it before the NVMe actor
// its tier pages through.
class train_session : public actors::tier_session {
 public:
  train_session(std::unique_ptr<models::offload_trainer> tr,
                const models::trainer::batch_source& data)
      : tr_(std::move(tr)), data_(data) {}
  std::string describe() override { return placement_line(*tr_); }
  double step() override {
    last_ = tr_->step(data_);
    return last_.loss;
  }
  memory::tier_report report() override { return tr_->tiers().report(); }
  const models::step_result& last() const { return last_; }
  models::offload_trainer& trainer() { return *tr_; }

 private:
  std::unique_ptr<models::offload_trainer> tr_;
  const models::trainer::batch_source& data_;
  models::step_result last_;
};

// Runs the steps on the one loop (models/train_loop.hpp), by hand or through the tier-manager
// actor; `one` runs one step. A failed step names the last checkpoint this run wrote.
int train_loop(const train_config& cfg, const models::hf::model_config& mcfg,
               models::offload_trainer& tr, models::causal_lm& staging,
               const std::function<models::step_result()>& one, const tiered_hooks& hooks) {
  auto report = hooks.progress(tr.steps_done());
  models::train_policy policy;
  policy.step = [&one](std::int64_t) { return one(); };
  policy.save = [&](const std::string& folder) { tr.save(folder, mcfg, staging).value(); };
  policy.failed = [&cfg](std::exception_ptr e, const models::train_progress& before) {
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      throw error(fmt::format(
          "troupe train: training stopped in step {}: {}{}", before.step + 1, x.what(),
          before.saved >= 0 ? fmt::format(" (the last checkpoint, step {}, in {} is intact)",
                                          before.saved, cfg.ckpt_dir)
                            : std::string(" (no checkpoint was written)")));
    } catch (...) {
      // Not a std::exception: it goes on as it is.
    }
  };
  models::train_hooks h;
  h.on_step = [&](const models::step_result& r) {
    report(r);
    if (r.step == 1 && tr.measured_non_model_bytes() > 0)
      fmt::print("automatic placement after measuring step 1: {}{}\n", placement_line(tr),
                 tr.replaced() ? " (chunks moved)" : " (unchanged)");
  };
  h.on_save = hooks.on_save;
  const auto run = models::run_train_loop(cfg, tr.steps_done(), policy, h);
  fmt::print("{}\n", models::trained_line(run));
  fmt::print("{}\n", tiers_line(tr));
  if (!cfg.ckpt_dir.empty())
    fmt::print("checkpoint: {} (HF layout + optimizer state)\n", cfg.ckpt_dir);
  return 0;
}

}  // namespace

int run_tiered(const train_config& cfg, const models::hf::model_config& mcfg,
               const tiered_hooks& hooks) {
  // The staging model carries weights in and out (initialisation, HF loading, checkpoints, the
  // sample): batch 1, so its activations are small.
  auto staging = models::make_causal_lm(mcfg, {1, cfg.seq});
  TROUPE_CHECK(cfg.seq <= staging->max_seq(), "--seq ", cfg.seq, " exceeds the model's ",
               staging->max_seq(), " positions");
  auto data =
      models::open_data_source(cfg.data_tokens, cfg.data_text, staging->vocab(), cfg.seed).value();
  // The trainer: its NVMe tier through `nvme_io` (the NVMe actor's client in a launched run) or
  // a store of its own (null).
  std::unique_ptr<models::offload_trainer> trainer;
  auto make_trainer = [&](std::shared_ptr<memory::io::page_io> nvme_io) {
    auto opt = options_of(cfg);
    opt.nvme_io = std::move(nvme_io);
    trainer = std::make_unique<models::offload_trainer>(mcfg, cfg, opt);
    auto& tr = *trainer;
    try {
      tr.check_budgets();
    } catch (const error& e) {
      throw error(fmt::format(
          "--device-memory {:.1f} MiB / --host-memory {} (memory.device / memory.host) do not hold "
          "a step: {}; the step's activations and scratch alone take {:.1f} MiB of the device, and "
          "a chunk is {} KiB",
          mib(static_cast<double>(cfg.mem_device)),
          cfg.mem_host ? fmt::format("{:.1f} MiB", mib(static_cast<double>(cfg.mem_host)))
                       : std::string("unlimited"),
          e.what(), mib(static_cast<double>(tr.non_model_bytes())),
          tr.chunking().layout.chunk_bytes >> 10));
    }
    if (!cfg.resume.empty()) {
      auto step = tr.resume(cfg.resume, mcfg, *staging).value();
      models::check_steps_left(step, cfg, cfg.resume);
      fmt::print("resumed {} at step {}\n", cfg.resume, step);
    } else {
      // bf16: the weights start as the plain bf16 trainer's do, in a bf16 model (the initial
      // draws rounded once), whose values the trainer takes as its f32 master weights.
      std::unique_ptr<models::causal_lm> init16;
      if (cfg.precision == "bf16") init16 = models::make_causal_lm(mcfg, {1, 1}, dtype::bf16);
      models::causal_lm& init = init16 ? *init16 : *staging;
      if (!cfg.model_hf.empty())
        models::hf::load_weights(cfg.model_hf, mcfg, init.slots()).value();
      else
        init.init_weights(cfg.seed);
      tr.set_weights(init.slots());
    }
    const auto& l = tr.chunking().layout;
    fmt::print(
        "troupe train: {} ({}), {:.2f} M parameters; B={} T={} grad_accum={}{}{}\n",
        hooks.model_label,
        models::with_family(mcfg, [](auto f, const auto&) { return decltype(f)::type::label; }),
        static_cast<double>(staging->slots().param_count()) / 1e6, cfg.batch, cfg.seq,
        cfg.grad_accum, cfg.recompute ? " (recompute)" : "",
        cfg.precision == "bf16" ? "; bf16 with f32 master weights" : "");
    fmt::print("data: {}; {} threads\n", data.description, parallel::num_threads());
    fmt::print(
        "memory tiers: device {:.1f} MiB, host {}, nvme {}; model state {:.1f} MiB in {} chunks "
        "of {} KiB; {} placement: {}\n",
        mib(static_cast<double>(cfg.mem_device)),
        cfg.mem_host ? fmt::format("{:.1f} MiB", mib(static_cast<double>(cfg.mem_host)))
                     : std::string("unlimited"),
        cfg.mem_nvme_dir.empty() ? std::string("none") : cfg.mem_nvme_dir,
        mib(static_cast<double>(tr.model_state_bytes())), l.chunks, l.chunk_bytes >> 10,
        options_of(cfg).placement.how == models::offload_placement::mode::automatic ? "automatic"
                                                                                    : "fixed",
        placement_line(tr));
    std::fflush(stdout);
  };

  int rc = 0;
  if (!actors::join_info_from_env().has_value()) {
    make_trainer(nullptr);
    auto& tr = *trainer;
    rc = train_loop(
        cfg, mcfg, tr, *staging, [&] { return tr.step(data.rows); }, hooks);
  } else {
    // Launched: the trainer runs in the tier-manager role actor, visible to troupe ps / top.
    train_session* session = nullptr;
    actors::role_registry roles;
    actors::add_tier_manager_role(
        roles, [&](const actors::tier_setup&, const actors::tier_resources& res) {
          make_trainer(res.nvme);  // the NVMe tier pages through the role's NVMe actor
          auto s = std::make_unique<train_session>(std::move(trainer), data.rows);
          session = s.get();
          return std::unique_ptr<actors::tier_session>(std::move(s));
        });
    actors::node_options o;
    o.roles = &roles;
    actors::node n(o);
    TROUPE_CHECK(n.world_size() == 1, "--device-memory: training with memory tiers runs on one ",
                 "rank; launched with ", n.world_size(), " (troupe launch -n 1)");
    std::exception_ptr failed;
    {
      actors::job jb(n);
      auto tm = jb.spawn(actors::tier_manager_role, 0, "tiers");
      actors::tier_setup setup;
      setup.model = hooks.model_label;
      setup.device_bytes = cfg.mem_device;
      setup.host_bytes = cfg.mem_host;
      setup.nvme_dir = cfg.mem_nvme_dir;
      try {
        fmt::print("tier-manager actor {}: {}\n", tm.name,
                   jb.ask<std::string>(tm, setup, std::chrono::minutes(10)));
        auto& tr = session->trainer();
        auto one = [&] {
          jb.ask<actors::tier_step_reply>(tm, actors::tier_step{1}, std::chrono::hours(24));
          return session->last();
        };
        rc = train_loop(cfg, mcfg, tr, *staging, one, hooks);
        // While the NVMe actor still serves its pages.
        if (hooks.done) tr.copy_weights_to(staging->slots());
      } catch (...) {
        failed = std::current_exception();  // rethrown once the job and the node are down
        trainer.reset();  // a trainer made by a failed setup holds the NVMe actor's client
      }
      jb.stop(tm);
    }
    n.shutdown();
    if (failed) std::rethrow_exception(failed);
  }
  if (hooks.done) {
    if (trainer) trainer->copy_weights_to(staging->slots());
    hooks.done(*staging);
  }
  return rc;
}

}  // namespace troupe::apps
