// The "trainer" role and drive_training (see training.hpp).
#include "actors/training.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>

#include "collective/grid.hpp"
#include "collective/p2p_communicator.hpp"
#include "memory/error.hpp"
#include "memory/tier.hpp"
#include "models/causal_lm.hpp"
#include "models/data_source.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/layers/slots.hpp"
#include "models/parallel/hybrid.hpp"

namespace troupe::actors {
namespace {

namespace mp = models::parallel;

// ---- requests and replies ------------------------------------------------------------------
struct setup_request {
  std::string config;  // models::to_toml of the run's train_config
  auto fields() { return std::tie(config); }
};
struct setup_reply {
  std::string line;       // "rank 1: dp 0 pp 1 tp 0, whole model, 1.2 M parameters"
  std::int64_t step = 0;  // steps done: checkpoint.resume's step, else 0
  auto fields() { return std::tie(line, step); }
};
struct step_request {
  std::int64_t step = 0;  // 0-based: the step about to run
  auto fields() { return std::tie(step); }
};
struct step_reply {
  double loss = 0, grad_norm = 0, lr = 0, seconds = 0, bubble = 0, comm_wait = 0;
  std::int64_t tokens = 0, step = 0;
  auto fields() { return std::tie(loss, grad_norm, lr, seconds, bubble, comm_wait, tokens, step); }
};
struct save_request {
  std::string dir;
  auto fields() { return std::tie(dir); }
};
struct save_reply {
  std::string written;  // the folder, on the rank that wrote it; else empty
  auto fields() { return std::tie(written); }
};

struct memory_request {
  std::int64_t unused = 0;
  auto fields() { return std::tie(unused); }
};
struct memory_reply {
  std::string line;  // memory_line's
  auto fields() { return std::tie(line); }
};

// ---- the trainer ---------------------------------------------------------------------------
struct trainer_state {
  std::mutex mu;
  models::train_config cfg;
  models::hf::model_config model;
  std::unique_ptr<collective::rank_grid> grid;
  std::vector<std::unique_ptr<collective::communicator>> comms;
  std::vector<collective_watch> watches;  // the comms' flight records in describe (after comms)
  std::unique_ptr<mp::hybrid_trainer> hybrid;
  models::data_source data;
  std::string broken;  // why a step failed: the piece's state is undefined from then on
};

std::int64_t vocab_of(const models::hf::model_config& m) {
  return std::visit([](const auto& c) { return c.vocab_size; }, m);
}

// Fails now, naming the folder, rather than after the last step when a checkpoint cannot be
// written there, or could not replace it without deleting files troupe did not write.
void probe_folder(const std::string& dir) {
  auto replaceable = models::hf::check_checkpoint_dir(dir);
  TROUPE_CHECK(replaceable.has_value(), "checkpoint.dir: ", replaceable.error_message());
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  TROUPE_CHECK(!ec, "checkpoint.dir ", dir, ": cannot create it: ", ec.message());
  const auto probe = std::filesystem::path(dir) / ".troupe-write-probe";
  {
    std::ofstream f(probe);
    f << "probe\n";
    TROUPE_CHECK(f.good(), "checkpoint.dir ", dir, ": cannot write into it");
  }
  std::filesystem::remove(probe, ec);
}

setup_reply setup(role_context& ctx, trainer_state& st, const setup_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(!st.hybrid, ctx.name(), ": already set up");
  st.cfg = models::parse_train_config(r.config, "the driver's job").value();
  const auto& plan = st.cfg.plan;
  node& n = ctx.node();
  TROUPE_CHECK(plan.world_size() == n.world_size(),
               "parallel.dp x parallel.pp x parallel.tp = ", plan.dp, " x ", plan.pp, " x ",
               plan.tp, " = ", plan.world_size(), " but the job has ", n.world_size(), " ranks");
  st.model = models::model_config_of(st.cfg);
  std::vector<collective::grid_axis> axes;
  for (const auto& a : plan.order) {
    int d = a == "dp" ? plan.dp : a == "pp" ? plan.pp : a == "tp" ? plan.tp : 1;
    axes.push_back({a, d});
  }
  st.grid = std::make_unique<collective::rank_grid>(axes);
  const int me = n.rank();
  auto comm = [&](const std::vector<std::string>& names, const char* label) {
    st.comms.push_back(collective::make_communicator(n.transport(), st.grid->group(me, names),
                                                     std::string("ucx:") + label));
    st.comms.back()->set_timeout(std::chrono::milliseconds(
        static_cast<std::int64_t>(st.cfg.collective_timeout * 1000.0 + 0.5)));
    st.watches.push_back(ctx.watch(*st.comms.back()));
    return st.comms.back().get();
  };
  mp::hybrid_groups g;
  g.dp = comm({"dp"}, "dp");
  g.pp = comm({"pp"}, "pp");
  g.tp = comm({"tp"}, "tp");
  g.mp = comm({"pp", "tp"}, "mp");
  const int dpc = st.grid->coord(me, "dp"), ppc = st.grid->coord(me, "pp"),
            tpc = st.grid->coord(me, "tp");
  ctx.set_mesh("dp", dpc);
  ctx.set_mesh("pp", ppc);
  ctx.set_mesh("tp", tpc);
  ctx.set_activity("building its piece");
  if (me == 0 && !st.cfg.ckpt_dir.empty()) probe_folder(st.cfg.ckpt_dir);
  // The piece only: its weights come one whole parameter at a time (init, model.hf or resume).
  st.hybrid = std::make_unique<mp::hybrid_trainer>(st.model, st.cfg, g);
  st.data = models::open_data_source(st.cfg.data_tokens, st.cfg.data_text, vocab_of(st.model),
                                     st.cfg.seed)
                .value();
  ctx.set_metric("parameters", static_cast<double>(st.hybrid->parameters()));
  ctx.set_activity("ready");
  return {fmt::format("rank {}: dp {} pp {} tp {}, {}, {:.2f} M parameters{}", me, dpc, ppc, tpc,
                      st.hybrid->describe(), st.hybrid->parameters() / 1e6,
                      st.cfg.resume.empty() ? std::string()
                                            : fmt::format(", resumed {} at step {}", st.cfg.resume,
                                                          st.hybrid->steps_done())),
          st.hybrid->steps_done()};
}

step_reply run_step(role_context& ctx, trainer_state& st, const step_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.hybrid, ctx.name(), ": step before setup");
  TROUPE_CHECK(r.step == st.hybrid->steps_done(), ctx.name(), ": asked for step ", r.step,
               " but it has done ", st.hybrid->steps_done());
  TROUPE_CHECK(st.broken.empty(), ctx.name(), ": an earlier step failed: ", st.broken);
  ctx.set_activity(fmt::format("step {}", r.step + 1));
  models::step_result res;
  try {
    res = st.hybrid->step(st.data.rows);
  } catch (const std::exception& e) {
    // Fail what this rank still has in flight; its peers learn of it through their own ops
    // (a lost or failed peer) or the driver tearing the job down.
    st.broken = e.what();
    for (auto& c : st.comms) c->abort(st.broken);
    ctx.set_activity("failed");
    throw;
  }
  step_reply out;
  out.loss = res.loss;
  out.grad_norm = res.grad_norm;
  out.lr = res.lr;
  out.seconds = res.seconds;
  out.tokens = res.tokens;
  out.step = res.step;
  out.bubble = st.hybrid->last_bubble_fraction();
  out.comm_wait = st.hybrid->last_comm_wait_seconds();
  // The step's series for introspection (the dashboard's charts): the bytes each memory tier this
  // process has used holds as the step ends.
  std::map<std::string, double> values = {
      {"loss", res.loss},
      {"grad_norm", res.grad_norm},
      {"lr", res.lr},
      {"tokens_per_s", res.tokens / std::max(res.seconds, 1e-9)},
      {"step_seconds", res.seconds},
      {"bubble", out.bubble},
      {"comm_wait_s", out.comm_wait}};
  for (int t = 0; t < memory::tier_count; ++t) {
    const auto tier = static_cast<memory::tier>(t);
    const auto used = memory::stats(tier);
    if (used.peak > 0)
      values["memory." + std::string(memory::tier_name(tier)) + "_bytes"] =
          static_cast<double>(used.in_use);
  }
  ctx.record_step(res.step, values);
  ctx.set_activity("idle");
  return out;
}

// The process's peak resident set (VmHWM of /proc/self/status) in kB; -1 where it cannot be read.
std::int64_t peak_rss_kb() {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("VmHWM:", 0) == 0) return std::atoll(line.c_str() + 6);
  return -1;
}

// "rank 0 memory: parameters 1843200 bytes at peak (whole model 3444736 bytes, 53.5%), host
// buffers 20.1 MiB at peak, VmHWM 61.2 MiB": the most parameter bytes (models/layers/slots.hpp's
// ledger) and host buffer bytes (memory/tier.hpp's) this process held at once, and its peak RSS.
memory_reply memory_line(role_context& ctx, trainer_state& st) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.hybrid, ctx.name(), ": memory report before setup");
  const auto peak = models::param_bytes().peak;
  const auto whole = st.hybrid->whole().numel * static_cast<std::int64_t>(sizeof(float));
  const std::string tiers = st.hybrid->moment_tiers_line();
  return {
      fmt::format("rank {} memory: parameters {} bytes at peak (whole model {} bytes, {:.1f}%), "
                  "host buffers {:.1f} MiB at peak, VmHWM {:.1f} MiB{}",
                  ctx.node().rank(), peak, whole, 100.0 * peak / std::max<std::int64_t>(whole, 1),
                  memory::stats(memory::tier::host).peak / 1048576.0, peak_rss_kb() / 1024.0,
                  tiers.empty() ? std::string() : "; " + tiers)};
}

save_reply save(role_context& ctx, trainer_state& st, const save_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.hybrid, ctx.name(), ": save before setup");
  ctx.set_activity("writing the checkpoint");
  // The weights and AdamW's moments are gathered from every rank, parameter by parameter and in
  // windows; one rank streams them into the folder.
  save_reply out;
  out.written = st.hybrid->save(r.dir);
  ctx.set_activity("idle");
  return out;
}

}  // namespace

void add_trainer_role(role_registry& roles) {
  roles.add("trainer", [](role_builder& b, role_context&) {
    auto st = std::make_shared<trainer_state>();
    b.on<setup_request>([st](role_context& c, const setup_request& r) { return setup(c, *st, r); });
    b.on<step_request>(
        [st](role_context& c, const step_request& r) { return run_step(c, *st, r); });
    b.on<save_request>([st](role_context& c, const save_request& r) { return save(c, *st, r); });
    b.on<memory_request>(
        [st](role_context& c, const memory_request&) { return memory_line(c, *st); });
  });
}

training_summary drive_training(node& n, const models::train_config& cfg, const drive_options& o) {
  cfg.validate();
  job j(n);
  auto trainers = j.spawn_on_all("trainer");
  TROUPE_CHECK(static_cast<int>(trainers.size()) == n.world_size(), "drive_training: spawned ",
               trainers.size(), " trainers in a job of ", n.world_size(), " ranks");
  training_summary sum;
  auto lines = j.ask_all<setup_reply>(trainers, setup_request{models::to_toml(cfg)},
                                      std::chrono::minutes(5));
  for (auto& l : lines) sum.ranks.push_back(l.line);
  const std::int64_t resumed = lines.front().step;  // checkpoint.resume: the step to go on from
  for (auto& l : lines)
    TROUPE_CHECK(l.step == resumed, "drive_training: the trainers resumed at different steps (",
                 resumed, " and ", l.step, ")");
  if (o.on_setup) o.on_setup(sum.ranks);
  // A stuck collective fails on the ranks that wait for it at its deadline, with the text that
  // names the ranks: the driver waits longer than that, so its own timeout does not come first.
  auto step_wait = o.step_timeout;
  if (cfg.collective_timeout > 0)
    step_wait = std::max(step_wait, std::chrono::milliseconds(static_cast<std::int64_t>(
                                        cfg.collective_timeout * 2000.0 + 60000.0)));
  // The launched run's policy on the one loop: a step is every trainer's step (the first rank's
  // loss, the slowest rank's time, the largest bubble and wait), a save every trainer's part of it.
  step_report rep;  // the last step's
  models::train_policy policy;
  policy.step = [&](std::int64_t s) {
    const auto replies = j.ask_all<step_reply>(trainers, step_request{s}, step_wait);
    rep = {};
    const auto& first = replies.front();
    rep.result.step = first.step;
    rep.result.loss = first.loss;
    rep.result.grad_norm = first.grad_norm;
    rep.result.lr = first.lr;
    rep.result.tokens = first.tokens;
    for (const auto& r : replies) {
      rep.result.seconds = std::max(rep.result.seconds, r.seconds);
      rep.bubble = std::max(rep.bubble, r.bubble);
      rep.comm_wait = std::max(rep.comm_wait, r.comm_wait);
    }
    return rep.result;
  };
  policy.save = [&](const std::string& folder) {
    for (auto& sv : j.ask_all<save_reply>(trainers, save_request{folder}, std::chrono::minutes(5)))
      if (!sv.written.empty()) sum.checkpoint = sv.written;
  };
  policy.failed = [&](std::exception_ptr, const models::train_progress&) {
    for (const auto& t : trainers) j.stop(t);
  };
  models::train_hooks hooks;
  hooks.on_step = [&](const models::step_result&) {
    if (o.on_step) o.on_step(rep);
  };
  hooks.on_save = o.on_save;
  sum.progress = models::run_train_loop(cfg, resumed, policy, hooks);
  for (auto& m : j.ask_all<memory_reply>(trainers, memory_request{}, std::chrono::minutes(1)))
    sum.memory.push_back(m.line);
  for (const auto& t : trainers) j.stop(t);
  return sum;
}

}  // namespace troupe::actors
