// plan_flags: the [parallel] flags of a launched run (--dp, --tp, --pp, --zero, --microbatches,
// ...), bound to train_config::plan. troupe train and troupe sft add the same flags with the same
// parsing; each flag given is applied over the job file's [parallel] (train_config::validate then
// checks the plan).
#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "memory/error.hpp"
#include "models/train_config.hpp"
#include "scheduler/plan.hpp"

namespace troupe::apps {

// The flags' values (nested in train_config::plan, so bound by hand).
struct plan_cli {
  int dp = 1, tp = 1, pp = 1, cp = 1, zero = 0, microbatches = 1, virtual_stages = 1;
  int ep = 1;
  bool sp = false, dp_overlap = true;
  std::string cp_mode = "ulysses";
  std::string schedule = "1f1b", pipe_p2p = "async", dp_bucket_bytes;
};

using config_flags =
    std::vector<std::pair<CLI::Option*, std::function<void(models::train_config&)>>>;

// Adds the flags to `sub`, bound to `p` (which must outlive the parse), and appends to `out` how
// each one, when given, sets the train_config.
inline void add_plan_flags(CLI::App* sub, plan_cli& p, config_flags& out) {
  using models::train_config;
  auto flag = [&](CLI::Option* opt, std::function<void(train_config&)> apply) {
    out.emplace_back(opt, std::move(apply));
  };
  plan_cli* pc = &p;
  flag(sub->add_option("--dp", p.dp, "Data-parallel degree")->capture_default_str(),
       [pc](train_config& t) { t.plan.dp = pc->dp; });
  flag(sub->add_option("--tp", p.tp, "Tensor-parallel degree")->capture_default_str(),
       [pc](train_config& t) { t.plan.tp = pc->tp; });
  flag(sub->add_option("--pp", p.pp, "Pipeline stages")->capture_default_str(),
       [pc](train_config& t) { t.plan.pp = pc->pp; });
  flag(sub->add_option("--ep", p.ep,
                       "Expert-parallel degree, out of the data-parallel ranks (MoE models)")
           ->capture_default_str(),
       [pc](train_config& t) { t.plan.ep = pc->ep; });
  flag(sub->add_flag("--sp", p.sp, "Sequence parallelism over the tp group"),
       [pc](train_config& t) { t.plan.sp = pc->sp; });
  flag(sub->add_option("--cp", p.cp,
                       "Context-parallel degree: every sample's sequence split over cp ranks")
           ->capture_default_str(),
       [pc](train_config& t) { t.plan.cp = pc->cp; });
  flag(sub->add_option("--cp-mode", p.cp_mode,
                       "How attention runs over the split sequence: ulysses (ring: not yet)")
           ->capture_default_str(),
       [pc](train_config& t) {
         auto m = scheduler::parse_cp_mode(pc->cp_mode);
         TROUPE_CHECK(m.has_value(), "--cp-mode must be ulysses or ring, got '", pc->cp_mode, "'");
         t.plan.cp_mode = *m;
       });
  flag(sub->add_option("--zero", p.zero, "ZeRO stage (0-3)")->capture_default_str(),
       [pc](train_config& t) { t.plan.zero = pc->zero; });
  flag(sub->add_option("--microbatches", p.microbatches,
                       "Microbatches per data-parallel rank and step")
           ->capture_default_str(),
       [pc](train_config& t) { t.plan.microbatches = pc->microbatches; });
  flag(sub->add_option("--schedule", p.schedule,
                       "Pipeline schedule: gpipe, 1f1b, eager-1f1b, zero-bubble, interleaved")
           ->capture_default_str(),
       [pc](train_config& t) {
         auto k = scheduler::parse_schedule_kind(pc->schedule);
         TROUPE_CHECK(
             k.has_value(),
             "--schedule must be gpipe, 1f1b, eager-1f1b, zero-bubble or interleaved, got '",
             pc->schedule, "'");
         t.plan.schedule = *k;
       });
  flag(sub->add_option("--virtual-stages", p.virtual_stages,
                       "Model chunks per pipeline stage (interleaved)")
           ->capture_default_str(),
       [pc](train_config& t) { t.plan.virtual_stages = pc->virtual_stages; });
  flag(sub->add_flag("--dp-overlap,!--no-dp-overlap", p.dp_overlap,
                     "Reduce gradient buckets during backward (--no-dp-overlap: after it)"),
       [pc](train_config& t) { t.plan.dp_overlap = pc->dp_overlap; });
  flag(sub->add_option("--dp-bucket-bytes", p.dp_bucket_bytes,
                       "Gradient bucket size of the data-parallel reduction (e.g. 256K)")
           ->default_str("25M"),
       [pc](train_config& t) {
         auto v = models::parse_byte_size(pc->dp_bucket_bytes);
         TROUPE_CHECK(v.has_value() && *v <= (1ULL << 50),
                      "--dp-bucket-bytes must be a size like 256K or 25M, got '",
                      pc->dp_bucket_bytes, "'");
         t.plan.dp_bucket_bytes = static_cast<long long>(*v);
       });
  flag(sub->add_option("--pipe-p2p", p.pipe_p2p,
                       "How pipeline stages wait for transfers: async, or batched (each "
                       "batch of the schedule's transfers waited where it stands)")
           ->capture_default_str(),
       [pc](train_config& t) {
         auto m = scheduler::parse_p2p_mode(pc->pipe_p2p);
         TROUPE_CHECK(m.has_value() && *m != scheduler::p2p_mode::blocking,
                      "--pipe-p2p must be async or batched, got '", pc->pipe_p2p, "'");
         t.plan.pipe_p2p = *m;
       });
}

// Applies the flags given (a count > 0) to `cfg`.
inline void apply_given(const config_flags& flags, models::train_config& cfg) {
  for (const auto& [opt, apply] : flags)
    if (opt->count() > 0) apply(cfg);
}

}  // namespace troupe::apps
