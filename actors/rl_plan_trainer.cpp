// rl_plan_trainer: an RL policy trainer as a grid of hybrid-parallel pieces (rl_plan_trainer.hpp).
#include "actors/rl_plan_trainer.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>

#include "actors/rl_model.hpp"
#include "collective/grid.hpp"
#include "collective/p2p_communicator.hpp"
#include "memory/error.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/hf/config.hpp"
#include "models/parallel/hybrid.hpp"
#include "models/post/plan_samples.hpp"
#include "models/train_config.hpp"
#include "scheduler/plan.hpp"
#include "tensor/ops.hpp"

namespace troupe::actors {
namespace {

namespace mp = models::parallel;

struct plan_state {
  models::train_config cfg;
  models::hf::model_config model;
  std::unique_ptr<collective::rank_grid> grid;
  std::vector<std::unique_ptr<collective::communicator>> comms;  // dp, pp, tp, mp
  std::vector<collective_watch> watches;                         // after comms
  std::unique_ptr<mp::hybrid_trainer> hybrid;
  models::grpo_options opt;
  std::shared_ptr<models::grpo_batch> batch = std::make_shared<models::grpo_batch>();
  mp::sample_source samples;
  std::map<std::int64_t, models::grpo_microbatch_result> seen;  // this step's, by first sample
  // PPO's policy: its batch, samples, epochs and what its objectives saw this step.
  std::shared_ptr<models::ppo_batch> ppo = std::make_shared<models::ppo_batch>();
  mp::sample_source ppo_samples;
  std::int64_t epochs = 1;
  std::map<std::int64_t, models::ppo_microbatch_result> ppo_seen;
  owned_tensor whole;  // rank 0: the gathered policy it pushes
  std::string broken;  // why a step failed: the pieces' state is undefined from then on
};

// The grid's axes in the plan's order (cp and ep are refused before a plan reaches here).
std::vector<collective::grid_axis> axes_of(const scheduler::parallel_plan& plan) {
  std::vector<collective::grid_axis> axes;
  for (const auto& a : scheduler::grid_order(plan))
    if (a != "cp" || plan.cp > 1) axes.push_back({a, scheduler::degree_of(plan, a)});
  return axes;
}

std::int64_t setup(role_context& c, plan_state& st, const rl_plan_setup& s) {
  TROUPE_CHECK(!st.hybrid, c.name(), ": already set up");
  st.cfg = models::parse_train_config(s.config, "the grpo driver's plan").value();
  const auto& plan = st.cfg.plan;
  TROUPE_CHECK(plan.cp == 1 && plan.ep == 1, c.name(), ": parallel.cp ", plan.cp,
               " and parallel.ep ", plan.ep, " are not supported for GRPO's trainer");
  auto model = models::hf::read_config(st.cfg.model_hf);
  TROUPE_CHECK(model.has_value(), c.name(), ": ", model.error_message());
  st.model = *model;
  node& n = c.node();
  st.grid = std::make_unique<collective::rank_grid>(axes_of(plan));
  const int me = n.rank();
  TROUPE_CHECK(me < st.grid->world_size(), c.name(), ": rank ", me, " is outside the plan's ",
               st.grid->world_size(), " ranks");
  static const std::vector<std::vector<std::string>> groups = {
      {"dp"}, {"pp"}, {"tp"}, {"pp", "tp"}};
  static const char* labels[] = {"ucx:dp", "ucx:pp", "ucx:tp", "ucx:mp"};
  for (std::size_t i = 0; i < groups.size(); ++i) {
    auto comm =
        collective::make_communicator(n.transport(), st.grid->group(me, groups[i]), labels[i]);
    comm->set_timeout(std::chrono::milliseconds(
        static_cast<std::int64_t>(st.cfg.collective_timeout * 1000.0 + 0.5)));
    st.comms.push_back(std::move(comm));
    st.watches.push_back(c.watch(*st.comms.back()));
  }
  mp::hybrid_groups g;
  g.dp = st.comms[0].get();
  g.pp = st.comms[1].get();
  g.tp = st.comms[2].get();
  g.mp = st.comms[3].get();
  c.set_mesh("dp", st.grid->coord(me, "dp"));
  c.set_mesh("pp", st.grid->coord(me, "pp"));
  c.set_mesh("tp", st.grid->coord(me, "tp"));
  c.set_activity("building its piece");
  st.hybrid = std::make_unique<mp::hybrid_trainer>(st.model, st.cfg, g);
  st.opt = {.epsilon = s.epsilon, .beta = s.beta};
  // Tensor shard 0 of each logit-holding piece counts what its objectives saw (every tp shard
  // evaluates the same objective on the same rows).
  const bool counts = st.grid->coord(me, "tp") == 0;
  plan_state* sp = &st;
  st.batch->rows = st.cfg.batch;  // its rows arrive with each step
  st.samples =
      models::grpo_samples(st.batch, st.opt, [sp, counts](const models::grpo_microbatch_result& r) {
        if (counts) sp->seen[r.begin] = r;
      });
  TROUPE_CHECK(s.epochs > 0, c.name(), ": epochs ", s.epochs, " must be > 0");
  st.epochs = s.epochs;
  st.ppo_samples = models::ppo_samples(st.ppo, {.cliprange = s.cliprange},
                                       [sp, counts](const models::ppo_microbatch_result& r) {
                                         if (counts) sp->ppo_seen[r.begin] = r;
                                       });
  c.set_metric("parameters", static_cast<double>(st.hybrid->parameters()));
  c.set_activity("idle");
  return st.hybrid->steps_done();
}

// Runs f; a failure marks the pieces broken and fails this rank's collectives (its peers then
// fail theirs instead of waiting for the deadline).
template <class F>
auto guarded(role_context& c, plan_state& st, F&& f) {
  TROUPE_CHECK(st.hybrid, c.name(), ": a request before the setup");
  TROUPE_CHECK(st.broken.empty(), c.name(), ": an earlier request failed: ", st.broken);
  try {
    return f();
  } catch (const std::exception& e) {
    st.broken = e.what();
    for (auto& comm : st.comms) comm->abort(st.broken);
    c.set_activity("failed");
    throw;
  }
}

grpo_plan_train_reply train(role_context& c, plan_state& st, const grpo_train_request& r) {
  return guarded(c, st, [&] {
    const grpo_samples& s = r.samples;
    TROUPE_CHECK(s.rows == st.cfg.batch && s.seq == st.cfg.seq, c.name(), ": samples of ", s.rows,
                 " x ", s.seq, " rows for a trainer planned for ", st.cfg.batch, " x ", st.cfg.seq);
    c.set_activity("training");
    models::grpo_batch& gb = *st.batch;
    gb.rows = s.rows;
    gb.seq = s.seq;
    gb.ids = s.ids;
    gb.targets = s.targets;
    gb.old_logp = s.old_logp;
    gb.ref_logp = r.ref_logp;
    gb.advantages = r.advantages;
    st.seen.clear();
    const auto step = st.hybrid->step(st.samples);
    grpo_plan_train_reply out;
    out.train = {.loss = step.loss,
                 .kl = 0,
                 .clip_ratio = 0,
                 .grad_norm = step.grad_norm,
                 .lr = step.lr,
                 .seconds = step.seconds,
                 .version = st.hybrid->steps_done()};
    for (const auto& [begin, m] : st.seen) {
      out.kl_part += m.weight * m.result.kl;
      out.clipped += std::round(m.result.clip_ratio * static_cast<double>(m.masked));
      out.masked += static_cast<double>(m.masked);
    }
    c.record_step(out.train.version, {{"loss", out.train.loss}});
    c.set_activity("idle");
    return out;
  });
}

ppo_plan_train_reply train_ppo(role_context& c, plan_state& st, const ppo_policy_train_request& r) {
  return guarded(c, st, [&] {
    const grpo_samples& s = r.samples;
    const auto n = static_cast<std::size_t>(s.rows * s.seq);
    TROUPE_CHECK(s.rows == st.cfg.batch && s.seq == st.cfg.seq && s.old_logp.size() == n &&
                     r.advantages.size() == n,
                 c.name(), ": samples of ", s.rows, " x ", s.seq, " rows with ", s.old_logp.size(),
                 " old log-probabilities and ", r.advantages.size(),
                 " advantages for a trainer planned for ", st.cfg.batch, " x ", st.cfg.seq);
    c.set_activity("training");
    models::ppo_batch& b = *st.ppo;
    b.rows = s.rows;
    b.seq = s.seq;
    b.ids = s.ids;
    b.targets = s.targets;
    b.old_logp = s.old_logp;
    b.advantages = r.advantages;
    // The single-process policy's epochs (ppo_roles.cpp: run_epochs), their means.
    ppo_plan_train_reply out;
    const auto epochs = static_cast<double>(st.epochs);
    for (std::int64_t e = 0; e < st.epochs; ++e) {
      st.ppo_seen.clear();
      const auto step = st.hybrid->step(st.ppo_samples);
      out.train.loss += step.loss / epochs;
      out.train.grad_norm = step.grad_norm;
      out.train.lr = step.lr;
      out.train.seconds += step.seconds;
      for (const auto& [begin, m] : st.ppo_seen) {
        out.clip_part += m.weight * m.clipfrac / epochs;
        out.kl_part += m.weight * m.approx_kl / epochs;
        out.entropy_part += m.weight * m.entropy / epochs;
      }
    }
    out.train.version = st.hybrid->steps_done();
    c.record_step(out.train.version, {{"loss", out.train.loss}});
    c.set_activity("idle");
    return out;
  });
}

grpo_push_reply push(role_context& c, plan_state& st, const grpo_push_request& r) {
  return guarded(c, st, [&] {
    c.set_activity("gathering the policy");
    const bool root = c.node().rank() == 0;
    if (root && !st.whole.view().defined()) st.whole = empty({st.hybrid->whole().numel});
    const auto t0 = std::chrono::steady_clock::now();
    const bool writer = st.hybrid->gather_parameters(root ? st.whole.view() : tensor());
    TROUPE_CHECK(writer == root, c.name(), ": the policy was gathered on another rank than 0");
    grpo_push_reply out{.version = st.hybrid->steps_done()};
    if (root) {
      out = push_rl_weights(c, st.whole.view(), st.hybrid->steps_done(), r.to);
      out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    c.set_activity("idle");
    return out;
  });
}

grpo_save_reply save(role_context& c, plan_state& st, const grpo_save_request& r) {
  return guarded(c, st, [&] {
    c.set_activity("saving");
    const auto held = models::hf::checkpoint_step(r.dir);
    st.hybrid->save(r.dir);
    c.set_activity("idle");
    return grpo_save_reply{.version = st.hybrid->steps_done(), .held = held.value_or(-1)};
  });
}

}  // namespace

void add_rl_plan_trainer_role(role_registry& roles) {
  roles.add("rl_plan_trainer", [](role_builder& b, role_context&) {
    auto st = std::make_shared<plan_state>();
    b.on<rl_plan_setup>([st](role_context& c, const rl_plan_setup& s) { return setup(c, *st, s); });
    b.on<grpo_train_request>(
        [st](role_context& c, const grpo_train_request& r) { return train(c, *st, r); });
    b.on<ppo_policy_train_request>(
        [st](role_context& c, const ppo_policy_train_request& r) { return train_ppo(c, *st, r); });
    b.on<grpo_push_request>(
        [st](role_context& c, const grpo_push_request& r) { return push(c, *st, r); });
    b.on<grpo_save_request>(
        [st](role_context& c, const grpo_save_request& r) { return save(c, *st, r); });
  });
}

grpo_train_reply combine_grpo_plan_replies(const std::vector<grpo_plan_train_reply>& replies) {
  TROUPE_CHECK(!replies.empty(), "grpo: no trainer replied");
  grpo_train_reply out = replies.front().train;
  double clipped = 0, masked = 0;
  for (const auto& r : replies) {
    out.kl += r.kl_part;
    clipped += r.clipped;
    masked += r.masked;
    out.seconds = std::max(out.seconds, r.train.seconds);
  }
  out.clip_ratio = masked > 0 ? clipped / masked : 0.0;
  return out;
}

ppo_train_reply combine_ppo_plan_replies(const std::vector<ppo_plan_train_reply>& replies) {
  TROUPE_CHECK(!replies.empty(), "ppo: no policy trainer replied");
  ppo_train_reply out = replies.front().train;
  out.clipfrac = 0;
  out.approx_kl = 0;
  out.entropy = 0;
  for (const auto& r : replies) {
    out.clipfrac += r.clip_part;
    out.approx_kl += r.kl_part;
    out.entropy += r.entropy_part;
    out.seconds = std::max(out.seconds, r.train.seconds);
  }
  return out;
}

}  // namespace troupe::actors
