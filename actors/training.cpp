// The "trainer" role and drive_training (see training.hpp).
#include "actors/training.hpp"

#include <fmt/core.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>

#include "actors/elastic.hpp"
#include "actors/expert_group.hpp"
#include "actors/joiners.hpp"
#include "actors/rebindable_communicator.hpp"
#include "collective/grid.hpp"
#include "collective/p2p_communicator.hpp"
#include "memory/error.hpp"
#include "memory/tier.hpp"
#include "models/causal_lm.hpp"
#include "models/chaos_kills.hpp"
#include "models/data_source.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/layers/slots.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/expert_parallel.hpp"
#include "models/parallel/hybrid.hpp"
#include "tensor/ops.hpp"

namespace troupe::actors {
namespace {

namespace mp = models::parallel;

// ---- requests and replies ------------------------------------------------------------------
struct setup_request {
  std::string config;          // models::to_toml of the run's train_config
  std::vector<int> positions;  // elastic: grid position -> rank (the rest are spares)
  // parallel.ep > 1: the expert-group actor of each rank (expert_group.hpp), by rank.
  std::vector<std::string> expert_names;
  std::vector<int> expert_channels;
  // A joiner (troupe launch --join) set up in a running elastic job: the layout's spares and
  // generation, and the steps committed when it arrived (>= 0; -1: set up with the job). The
  // config is the current plan's (a shrunk dp and its micro-batches).
  std::vector<int> spares;
  std::int32_t generation = 0;
  std::int64_t joined_at = -1;
  auto fields() {
    return std::tie(config, positions, expert_names, expert_channels, spares, generation,
                    joined_at);
  }
};
struct setup_reply {
  std::string line;       // "rank 1: dp 0 pp 1 tp 0, whole model, 1.2 M parameters"
  std::int64_t step = 0;  // steps done: checkpoint.resume's step, else 0 (-1: a spare)
  auto fields() { return std::tie(line, step); }
};
// phase 0: the whole step; 1 (elastic): prepare it (forward, backward, gradient collectives),
// then commit_request applies it.
struct step_request {
  std::int64_t step = 0;  // 0-based: the step about to run
  std::int32_t generation = 0;
  std::int32_t phase = 0;
  auto fields() { return std::tie(step, generation, phase); }
};
struct commit_request {
  std::int64_t step = 0;
  std::int32_t generation = 0;
  auto fields() { return std::tie(step, generation); }
};
struct status_request {
  std::int64_t unused = 0;
  auto fields() { return std::tie(unused); }
};
struct status_reply {
  std::int64_t steps = 0, optimizer_steps = 0;
  std::int32_t generation = 0;
  // Buddy replicas: the step of this rank's own snapshot (-1: none) and its optimizer steps.
  std::int64_t replica_steps = -1, replica_optimizer_steps = 0;
  auto fields() {
    return std::tie(steps, optimizer_steps, generation, replica_steps, replica_optimizer_steps);
  }
};
// Buddy replicas, in two phases like a step: every rank sends its piece state to its buddy (the
// next position) and receives its left neighbour's into a staging copy; once all have, every rank
// keeps a snapshot of its own state and makes the staging copy its buddy replica (local).
struct replicate_request {
  std::int64_t step = 0;  // steps done
  std::int32_t generation = 0;
  std::int32_t phase = 0;  // 0: exchange into staging; 1: keep (snapshot and swap)
  auto fields() { return std::tie(step, generation, phase); }
};
struct replicate_reply {
  std::int64_t bytes = 0;
  auto fields() { return std::tie(bytes); }
};
// Elastic recovery: the next generation's layout and, per replaced position, the spare taking it
// and the survivor sending it the piece's state; steps and optimizer_steps are the last committed.
struct recover_request {
  std::int32_t generation = 0;
  std::vector<int> positions, spares;
  std::vector<int> move_position, move_spare, move_donor;
  std::vector<int> move_buddy;  // 1: the donor sends its buddy replica of the position
  // steps: the step every rank goes on from; a survivor past it (buddy replicas: the last
  // replicated step) goes back to its own snapshot.
  std::int64_t steps = 0, optimizer_steps = 0;
  auto fields() {
    return std::tie(generation, positions, spares, move_position, move_spare, move_donor,
                    move_buddy, steps, optimizer_steps);
  }
};
// Elastic shrinking (plan_shrink): every live rank takes the next generation's smaller grid (dp
// and microbatches of the new plan); a rank holding a position of it rebuilds its piece under the
// new plan with the state it holds (ZeRO 0: the whole piece's), the others idle as spares.
struct shrink_request {
  std::int32_t generation = 0;
  std::vector<int> positions, spares;
  std::int32_t dp = 0, microbatches = 0;
  std::int64_t steps = 0, optimizer_steps = 0;  // the last committed (ZeRO: replicated)
  // ZeRO 1-3: the old grid's positions and the lost ranks; every survivor takes part in putting
  // the whole state together from the shards of the last replicated step (a lost rank's from its
  // buddy holder), and each new position takes its new shard of it.
  std::vector<int> old_positions, lost;
  // Growing back (plan_grow, ZeRO 0): the same request with a larger dp and fewer micro-batches;
  // each new replica's position goes to a spare (a joiner, or a survivor a shrink left idle),
  // which builds the piece and receives its state from the donor (the piece's dp 0 holder).
  std::vector<int> move_position, move_spare, move_donor;
  auto fields() {
    return std::tie(generation, positions, spares, dp, microbatches, steps, optimizer_steps,
                    old_positions, lost, move_position, move_spare, move_donor);
  }
};
// Elastic, no way on: the ranks of one whole surviving data-parallel replica save the last
// committed step on their own (their dp communicator becomes just themselves).
struct salvage_request {
  std::int32_t generation = 0;
  std::string dir;
  auto fields() { return std::tie(generation, dir); }
};
// Elastic, no survivor holds a lost piece (a rank and its buddy lost together, or no donor) but
// checkpoint.dir holds a save of a committed step: every rank of the next layout (spares too)
// takes it, and the ranks holding positions build their pieces from the checkpoint in `dir`.
struct reload_request {
  std::int32_t generation = 0;
  std::vector<int> positions, spares;
  std::string dir;
  std::int64_t steps = 0;  // the checkpoint's step
  auto fields() { return std::tie(generation, positions, spares, dir, steps); }
};
struct recover_reply {
  std::string line;
  std::int64_t bytes = 0;  // piece state sent or received
  auto fields() { return std::tie(line, bytes); }
};
struct step_reply {
  double loss = 0, grad_norm = 0, lr = 0, seconds = 0, bubble = 0, comm_wait = 0;
  std::int64_t tokens = 0, step = 0;
  double all_to_all = 0;  // parallel.ep > 1: seconds in the MoE all-to-alls
  double loss_scale = 1;  // f16: the step's loss scale, and whether the grid skipped it
  bool skipped = false;
  auto fields() {
    return std::tie(loss, grad_norm, lr, seconds, bubble, comm_wait, tokens, step, all_to_all,
                    loss_scale, skipped);
  }
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
  // dp, pp, tp, mp: rebindable, so that elastic recovery puts new ones under the piece. Added to
  // (a promoted spare) under layout_mu; never removed before the state goes.
  std::vector<std::unique_ptr<rebindable_communicator>> comms;
  std::vector<collective_watch> watches;  // the comms' flight records in describe (after comms)
  std::unique_ptr<mp::hybrid_trainer> hybrid;
  models::data_source data;
  // A post-training run (add_trainer_role with trainer_samples): its model and samples.
  std::shared_ptr<const trainer_samples> post;
  mp::sample_source samples;
  std::string broken;  // why a step failed: the piece's state is undefined from then on
  // Elastic runs: who holds which grid position (read by the membership callback), the callback,
  // and the drill (elastic.chaos_kill).
  bool elastic = false;
  std::mutex layout_mu;
  elastic_layout layout;
  node* n = nullptr;
  int membership_callback = -1;
  std::vector<models::chaos_kill> chaos;
  // Buddy replicas (elastic.replica_interval): this rank's own state and its left neighbour's at
  // the last replicated step, the neighbour's next copy while it arrives, and the two pair
  // communicators of the current generation.
  struct snapshot {
    owned_tensor params, m, v;
    std::int64_t steps = -1, optimizer_steps = 0;
  };
  snapshot own, buddy, staging;
  std::unique_ptr<collective::communicator> buddy_out, buddy_in;
  int buddy_generation = -1;
  // parallel.ep > 1: this rank's expert-group actor, told each step's load.
  std::optional<role_handle> experts;
  bool experts_failed = false;  // reported once; training goes on without the reports
};

// Copies `from` into `to`, allocated to its sizes when they differ.
void keep(const tensor& from, owned_tensor& to) {
  if (!to.view().defined() || to.view().numel() != from.numel()) to = empty({from.numel()});
  ops::copy(from.reshape({from.numel()}), to.view());
}

// The groups of a rank: dp, pp, tp, mp and, with context parallelism (parallel.cp > 1), cp and
// dp x cp (cp fastest: scheduler::validate keeps "cp" after "dp" in the grid order), or with
// expert parallelism (parallel.ep > 1) ep and edp (expert_groups).
const std::vector<std::string>& group_axes(std::size_t i) {
  static const std::vector<std::vector<std::string>> axes = {{"dp"},       {"pp"}, {"tp"},
                                                             {"pp", "tp"}, {"cp"}, {"dp", "cp"}};
  return axes[i];
}
constexpr const char* group_labels[] = {"dp", "pp", "tp", "mp", "cp", "dpcp"};
constexpr const char* expert_group_labels[] = {"ep", "edp"};
std::size_t group_count(const scheduler::parallel_plan& plan) {
  return plan.cp > 1 || plan.ep > 1 ? 6 : 4;
}

// Expert parallelism: the ep consecutive dp ranks from d / ep * ep (this rank's expert-parallel
// group) and the dp ranks with d % ep equal (its expert-data-parallel group), carved out of its
// dp group as scheduler/plan.hpp says. Their ids sit beside the grid's (bits 20-22: the axis
// mask) and the elastic restore and buddy groups' (bit 23, bit 22 clear): bits 23 and 22 set,
// bit 21 telling the two apart, the low bits the dp group's fixed coordinates and the index.
collective::rank_group expert_group(const trainer_state& st, int position, bool edp) {
  const auto dp = elastic_group(*st.grid, st.layout, position, {"dp"});
  const int ep = st.cfg.plan.ep, size = static_cast<int>(dp.ranks.size());
  const int d = st.grid->coord(position, "dp");
  TROUPE_CHECK(ep >= 1 && size % ep == 0, "parallel.ep (--ep) ", ep, " does not divide the ", size,
               " ranks of the dp group");
  collective::rank_group g;
  const std::uint32_t base = (dp.id & 0xFFFFFu) * static_cast<std::uint32_t>(size);
  if (edp) {
    for (int i = d % ep; i < size; i += ep)
      g.ranks.push_back(dp.ranks[static_cast<std::size_t>(i)]);
    g.id = (1u << 23) | (1u << 22) | (1u << 21) | (base + static_cast<std::uint32_t>(d % ep));
  } else {
    for (int i = d / ep * ep; i < d / ep * ep + ep; ++i)
      g.ranks.push_back(dp.ranks[static_cast<std::size_t>(i)]);
    g.id = (1u << 23) | (1u << 22) | (base + static_cast<std::uint32_t>(d / ep));
  }
  TROUPE_CHECK(base + static_cast<std::uint32_t>(size) < (1u << 21), "parallel.ep (--ep) ", ep,
               ": the expert groups' ids do not fit (", size, " dp ranks)");
  return g;
}
// The grid's axes: the plan's order, with "cp" (scheduler::grid_order) only when it splits.
std::vector<collective::grid_axis> grid_axes_of(const scheduler::parallel_plan& plan) {
  std::vector<collective::grid_axis> axes;
  for (const auto& a : scheduler::grid_order(plan))
    if (a != "cp" || plan.cp > 1) axes.push_back({a, scheduler::degree_of(plan, a)});
  return axes;
}

// The communicators of `position` in the current layout (its generation's group ids): made the
// first time, else put under the piece's rebindable ones (the old ones are destroyed).
// any_shape: the group's size and this rank's place in it may change (a shrink).
void bind_comms(role_context& ctx, trainer_state& st, int position, bool any_shape = false) {
  node& n = ctx.node();
  for (std::size_t i = 0; i < group_count(st.cfg.plan); ++i) {
    const bool experts = i >= 4 && st.cfg.plan.ep > 1;
    auto g = experts ? expert_group(st, position, i == 5)
                     : elastic_group(*st.grid, st.layout, position, group_axes(i));
    auto c = collective::make_communicator(
        n.transport(), g,
        std::string("ucx:") + (experts ? expert_group_labels[i - 4] : group_labels[i]));
    c->set_timeout(std::chrono::milliseconds(
        static_cast<std::int64_t>(st.cfg.collective_timeout * 1000.0 + 0.5)));
    // Elastic: no direct allreduce (peers writing into each other's buffers with
    // process_vm_writev). When a step is abandoned, a rank in a direct allreduce waits until each
    // peer has stopped or is lost, since it may still write there; a survivor aborted in another
    // op never says it stopped, so the wait lasts the collective deadline. The ring and recursive
    // doubling only receive into their own buffers.
    if (auto* p2p = dynamic_cast<collective::p2p_communicator*>(c.get()); p2p && st.elastic) {
      auto tune = p2p->tuning();
      tune.allreduce_direct = false;
      p2p->set_tuning(tune);
    }
    if (st.comms.size() > i) {
      st.comms[i]->rebind(std::move(c), any_shape);
      st.watches[i] = ctx.watch(*st.comms[i]);  // introspection names the new one
      continue;
    }
    auto w = std::make_unique<rebindable_communicator>(std::move(c));
    st.watches.push_back(ctx.watch(*w));
    std::lock_guard lk(st.layout_mu);
    st.comms.push_back(std::move(w));
  }
}

mp::hybrid_groups groups_of(trainer_state& st) {
  mp::hybrid_groups g;
  g.dp = st.comms[0].get();
  g.pp = st.comms[1].get();
  g.tp = st.comms[2].get();
  g.mp = st.comms[3].get();
  if (st.comms.size() > 5 && st.cfg.plan.ep > 1) {
    g.ep = st.comms[4].get();
    g.edp = st.comms[5].get();
  } else if (st.comms.size() > 5) {
    g.cp = st.comms[4].get();
    g.dp_cp = st.comms[5].get();
  }
  return g;
}

void set_mesh_of(role_context& ctx, const trainer_state& st, int position) {
  ctx.set_mesh("dp", st.grid->coord(position, "dp"));
  ctx.set_mesh("pp", st.grid->coord(position, "pp"));
  ctx.set_mesh("tp", st.grid->coord(position, "tp"));
  if (st.cfg.plan.cp > 1) ctx.set_mesh("cp", st.grid->coord(position, "cp"));
  if (st.cfg.plan.ep > 1) ctx.set_mesh("ep", st.grid->coord(position, "dp") % st.cfg.plan.ep);
}

// Elastic: a lost rank that holds a grid position fails every op of this rank's communicators at
// once (its peers' too: every survivor hears of the loss), so the step in progress ends on every
// rank without waiting for a deadline; the driver then recovers.
void watch_losses(node& n, const std::shared_ptr<trainer_state>& sp) {
  std::weak_ptr<trainer_state> weak = sp;
  const int me = n.rank();
  sp->membership_callback = n.on_membership([weak, me](const member_event& e) {
    if (e.kind == member_event::joined) return;
    auto st = weak.lock();
    if (!st) return;
    std::vector<rebindable_communicator*> comms;
    {
      std::lock_guard lk(st->layout_mu);
      if (st->layout.position_of(e.rank) < 0 || st->layout.position_of(me) < 0) return;
      for (auto& c : st->comms) comms.push_back(c.get());
    }
    const std::string why =
        fmt::format("rank {} {}: {} (elastic: this step is abandoned)", e.rank,
                    e.kind == member_event::lost ? "was lost" : "left the job", e.reason);
    for (auto* c : comms) c->abort(why);
  });
}

// elastic.chaos_kill (models/chaos_kills.hpp): whether an entry names this rank, step `step` + 1
// (`step`: 0-based) and `phase`. Each entry fires once: the first time the process gets there
// (in whatever generation: a spare that took a place can be named too), and the process ends.
bool chaos_due(const trainer_state& st, int rank, std::int64_t step, const char* phase) {
  for (const auto& k : st.chaos)
    if (k.rank == rank && k.step == step + 1 && k.phase == phase) return true;
  return false;
}
// This process ends itself, as SIGKILL from outside would.
void chaos_kill_now(int rank, std::int64_t step, const char* phase) {
  std::fprintf(stderr, "troupe: rank %d: elastic.chaos_kill: SIGKILL in step %lld (%s)\n", rank,
               static_cast<long long>(step + 1), phase);
  std::fflush(stderr);
  ::kill(::getpid(), SIGKILL);
}
void maybe_chaos_kill(const trainer_state& st, node& n, std::int64_t step, const char* phase) {
  if (chaos_due(st, n.rank(), step, phase)) chaos_kill_now(n.rank(), step, phase);
}

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

setup_reply setup(role_context& ctx, const std::shared_ptr<trainer_state>& sp,
                  const setup_request& r) {
  trainer_state& st = *sp;
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(!st.hybrid && !st.grid, ctx.name(), ": already set up");
  st.cfg = models::parse_train_config(r.config, "the driver's job").value();
  const auto& plan = st.cfg.plan;
  node& n = ctx.node();
  st.n = &n;
  st.elastic = st.cfg.elastic();
  const int spares = st.elastic ? st.cfg.elastic_spares : 0;
  TROUPE_CHECK(!st.elastic || plan.cp == 1,
               "elastic runs (--elastic) with context parallelism (parallel.cp = ", plan.cp,
               ") are not supported yet");
  TROUPE_CHECK(plan.ep == 1 || (plan.cp == 1 && !st.elastic), "parallel.ep (--ep) ", plan.ep,
               " with ",
               plan.cp > 1 ? fmt::format("parallel.cp (--cp) {}", plan.cp)
                           : std::string("elastic runs (--elastic)"),
               ": expert parallelism does not compose with them yet");
  const bool joiner = r.joined_at >= 0;
  TROUPE_CHECK(joiner || plan.world_size() + spares == n.world_size(),
               "parallel.dp x parallel.pp x parallel.tp", plan.cp > 1 ? " x parallel.cp" : "",
               " = ", plan.dp, " x ", plan.pp, " x ", plan.tp,
               plan.cp > 1 ? fmt::format(" x {}", plan.cp) : std::string(), " = ",
               plan.world_size(),
               spares > 0 ? fmt::format(" plus elastic.spares {}", spares) : std::string(),
               " but the job has ", n.world_size(), " ranks");
  TROUPE_CHECK(!st.post || !st.elastic,
               "elastic runs (elastic.enabled, elastic.spares) of post-training (troupe sft) are "
               "not supported yet");
  st.model = st.post ? st.post->model : models::model_config_of(st.cfg);
  st.grid = std::make_unique<collective::rank_grid>(grid_axes_of(plan));
  st.layout = elastic_layout::initial(plan.world_size(), n.world_size());
  if (!r.positions.empty()) {
    TROUPE_CHECK(static_cast<int>(r.positions.size()) == plan.world_size(), ctx.name(),
                 ": the driver gave ", r.positions.size(), " grid positions for a plan of ",
                 plan.world_size());
    st.layout.positions = r.positions;
  }
  const int me = n.rank();
  if (joiner) {
    // Its number may still hold a position (the lost process's, until the recovery): not its own.
    for (auto& p : st.layout.positions)
      if (p == me) p = -1;
    st.layout.spares = r.spares;
    st.layout.generation = r.generation;
  }
  if (!st.cfg.elastic_chaos_kill.empty())
    st.chaos = models::parse_chaos_kills(st.cfg.elastic_chaos_kill).value();
  // A joiner holds the number of a lost rank: the drill's entries of steps up to the one it
  // joined at (the one that ended that rank among them) are behind the job, not for it.
  if (joiner)
    std::erase_if(st.chaos, [&](const models::chaos_kill& k) {
      return k.rank == me && k.step <= r.joined_at + 1;
    });
  if (st.post)
    st.samples = st.post->make(st.cfg);
  else
    st.data = models::open_data_source(st.cfg.data_tokens, st.cfg.data_text, vocab_of(st.model),
                                       st.cfg.seed)
                  .value();
  if (st.elastic) {
    watch_losses(n, sp);
    ctx.set_metric("elastic.generation", st.layout.generation);
  }
  const int position = st.layout.position_of(me);
  if (position < 0 || joiner) {
    ctx.set_activity(joiner ? fmt::format("spare (joined at step {}): idle until a rank is lost or "
                                          "the run grows",
                                          r.joined_at)
                            : std::string("spare: idle until a rank is lost"));
    ctx.set_metric("elastic.spare", 1);
    return {
        joiner ? fmt::format("rank {}: a joiner, spare at generation {} (holds no piece; takes "
                             "a lost rank's place or a new replica's)",
                             me, r.generation)
               : fmt::format("rank {}: spare (holds no piece; takes the place of a lost rank)", me),
        -1};
  }
  if (static_cast<std::size_t>(me) < r.expert_names.size() &&
      static_cast<std::size_t>(me) < r.expert_channels.size())
    st.experts =
        role_handle{r.expert_names[static_cast<std::size_t>(me)], "expert-group", me,
                    static_cast<std::uint16_t>(r.expert_channels[static_cast<std::size_t>(me)])};
  bind_comms(ctx, st, position);
  const mp::hybrid_groups g = groups_of(st);
  const int dpc = st.grid->coord(position, "dp"), ppc = st.grid->coord(position, "pp"),
            tpc = st.grid->coord(position, "tp");
  set_mesh_of(ctx, st, position);
  ctx.set_activity("building its piece");
  if (me == 0 && !st.cfg.ckpt_dir.empty()) probe_folder(st.cfg.ckpt_dir);
  // The piece only: its weights come one whole parameter at a time (init, model.hf or resume).
  st.hybrid = std::make_unique<mp::hybrid_trainer>(st.model, st.cfg, g);
  ctx.set_metric("parameters", static_cast<double>(st.hybrid->parameters()));
  ctx.set_activity("ready");
  return {fmt::format("rank {}: dp {} pp {} tp {}, {}, {:.2f} M parameters{}", me, dpc, ppc, tpc,
                      st.hybrid->describe(), st.hybrid->parameters() / 1e6,
                      st.cfg.resume.empty() ? std::string()
                                            : fmt::format(", resumed {} at step {}", st.cfg.resume,
                                                          st.hybrid->steps_done())),
          st.hybrid->steps_done()};
}

// parallel.ep > 1: the step's load of this rank's experts to its expert-group actor. A failed
// report is said once on stderr and training goes on (introspection only).
void report_expert_load(role_context& ctx, trainer_state& st, std::int64_t step) {
  const mp::ep_step_load* l = st.hybrid->last_expert_load();
  if (l == nullptr || !st.experts || st.experts_failed) return;
  node& n = ctx.node();
  const int position = st.layout.position_of(n.rank());
  expert_load_report r;
  r.step = step;
  r.dp = st.grid->coord(position, "dp");
  r.ep = r.dp % st.cfg.plan.ep;
  r.edp = r.dp / st.cfg.plan.ep;
  r.first_expert = l->first_expert;
  r.tokens = l->tokens;
  r.served = l->served;
  r.dropped = l->dropped;
  r.imbalance = l->imbalance;
  r.all_to_all_s = l->exchange_seconds;
  r.compute_s = l->compute_seconds;
  try {
    job side(n);  // a job object belongs to the thread that uses it: made here, for the ask
    side.ask<expert_load_ack>(*st.experts, r, std::chrono::seconds(30));
  } catch (const std::exception& e) {
    st.experts_failed = true;
    std::fprintf(stderr, "troupe: rank %d: the expert load of step %lld did not reach %s: %s\n",
                 n.rank(), static_cast<long long>(step), st.experts->name.c_str(), e.what());
  }
}

// A step's reply and its series for introspection.
step_reply step_done(role_context& ctx, trainer_state& st, const models::step_result& res);

step_reply run_step(role_context& ctx, trainer_state& st, const step_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.hybrid, ctx.name(), ": step before setup");
  TROUPE_CHECK(r.generation == st.layout.generation, ctx.name(), ": asked for step ", r.step + 1,
               " of generation ", r.generation, " but it is at generation ", st.layout.generation);
  TROUPE_CHECK(r.step == st.hybrid->steps_done(), ctx.name(), ": asked for step ", r.step,
               " but it has done ", st.hybrid->steps_done());
  TROUPE_CHECK(st.broken.empty(), ctx.name(), ": an earlier step failed: ", st.broken);
  ctx.set_activity(fmt::format("step {}", r.step + 1));
  models::step_result res;
  try {
    maybe_chaos_kill(st, ctx.node(), r.step, "forward");
    if (r.phase == 1) {
      // The drill's "backward": at the step's first gradient reduction on the dp group (issued
      // from the backward pass, after the forward); dp 1 issues none: once prepare is done.
      const bool backward = chaos_due(st, ctx.node().rank(), r.step, "backward");
      if (backward)
        st.comms[0]->before_next_reduction(
            [rank = ctx.node().rank(), step = r.step] { chaos_kill_now(rank, step, "backward"); });
      st.hybrid->prepare(st.data.rows);
      if (backward) chaos_kill_now(ctx.node().rank(), r.step, "backward");
      ctx.set_activity(fmt::format("step {} prepared", r.step + 1));
      step_reply out;
      out.step = r.step + 1;
      return out;
    }
    res = st.samples ? st.hybrid->step(st.samples) : st.hybrid->step(st.data.rows);
  } catch (const std::exception& e) {
    // Fail what this rank still has in flight; its peers learn of it through their own ops
    // (a lost or failed peer) or the driver tearing the job down.
    st.broken = e.what();
    for (auto& c : st.comms) c->abort(st.broken);
    ctx.set_activity("failed");
    throw;
  }
  return step_done(ctx, st, res);
}

// Elastic: every rank prepared step r.step; its optimizer step (the commit point) runs here.
step_reply commit_step(role_context& ctx, trainer_state& st, const commit_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.hybrid, ctx.name(), ": commit before setup");
  TROUPE_CHECK(r.generation == st.layout.generation && r.step == st.hybrid->steps_done(),
               ctx.name(), ": asked to commit step ", r.step + 1, " of generation ", r.generation,
               " but it has done ", st.hybrid->steps_done(), " at generation ",
               st.layout.generation);
  maybe_chaos_kill(st, ctx.node(), r.step, "commit");
  const auto res = st.hybrid->commit();
  maybe_chaos_kill(st, ctx.node(), r.step, "optimizer");  // its AdamW ran; no reply goes out
  return step_done(ctx, st, res);
}

step_reply step_done(role_context& ctx, trainer_state& st, const models::step_result& res) {
  step_reply out;
  out.loss = res.loss;
  out.grad_norm = res.grad_norm;
  out.lr = res.lr;
  out.seconds = res.seconds;
  out.tokens = res.tokens;
  out.step = res.step;
  out.loss_scale = res.loss_scale;
  out.skipped = res.skipped;
  out.bubble = st.hybrid->last_bubble_fraction();
  out.comm_wait = st.hybrid->last_comm_wait_seconds();
  if (const auto* l = st.hybrid->last_expert_load()) out.all_to_all = l->exchange_seconds;
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
  report_expert_load(ctx, st, res.step);
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

status_reply status(role_context& ctx, trainer_state& st) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.hybrid, ctx.name(), ": status of a trainer that holds no piece");
  // Not state(): under ZeRO 1 and 2 that makes the shard the parameters' copy of record, which
  // only every rank of the dp group together may do (status asks the survivors only).
  return {st.hybrid->steps_done(), st.hybrid->optimizer_steps(), st.layout.generation, st.own.steps,
          st.own.optimizer_steps};
}

std::unique_ptr<collective::communicator> pair_comm(node& n, const collective::rank_group& g,
                                                    const trainer_state& st,
                                                    const char* label = "ucx:buddy") {
  auto c = collective::make_communicator(n.transport(), g, label);
  c->set_timeout(std::chrono::milliseconds(
      static_cast<std::int64_t>(st.cfg.collective_timeout * 1000.0 + 0.5)));
  return c;
}

// A piece's state (parameters, m, v) from the donor to the other rank of the pair g (a recovery's
// spare, a grown replica): both ranks call it; returns the bytes moved.
std::int64_t move_state(node& n, const trainer_state& st, const collective::rank_group& g,
                        bool donor, const std::array<tensor, 3>& parts, const std::string& who) {
  auto c = pair_comm(n, g, st, "ucx:restore");
  std::int64_t bytes = 0;
  for (const tensor& t : parts) {
    TROUPE_CHECK(t.type() == dtype::f32 && t.is_contiguous(), who,
                 ": piece state must be contiguous f32");
    const auto count = static_cast<std::size_t>(t.numel());
    if (donor)
      c->send(t.data(), count, dtype::f32, 1).wait();
    else
      c->recv(t.data(), count, dtype::f32, 0).wait();
    bytes += t.numel() * 4;
  }
  return bytes;
}

replicate_reply replicate(role_context& ctx, trainer_state& st, const replicate_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.hybrid && st.elastic, ctx.name(), ": replicate without a piece");
  TROUPE_CHECK(r.generation == st.layout.generation && r.step == st.hybrid->steps_done(),
               ctx.name(), ": asked to replicate step ", r.step, " of generation ", r.generation,
               " but it has done ", st.hybrid->steps_done(), " at generation ",
               st.layout.generation);
  const auto s = st.hybrid->state();
  if (r.phase == 1) {  // every rank has its neighbour's copy in staging: keep both
    keep(s.params, st.own.params);
    keep(s.m, st.own.m);
    keep(s.v, st.own.v);
    st.own.steps = s.steps;
    st.own.optimizer_steps = s.optimizer_steps;
    std::swap(st.buddy, st.staging);
    st.buddy.steps = r.step;
    ctx.set_metric("elastic.replica_step", static_cast<double>(r.step));
    return {};
  }
  node& n = ctx.node();
  const int me = n.rank();
  const int npos = static_cast<int>(st.layout.positions.size());
  const int p = st.layout.position_of(me);
  if (npos < 2) return {};
  const int left_pos = (p + npos - 1) % npos;
  const int right = st.layout.positions[static_cast<std::size_t>(buddy_holder(p, npos))];
  const int left = st.layout.positions[static_cast<std::size_t>(left_pos)];
  if (st.buddy_generation != st.layout.generation) {
    st.buddy_out = pair_comm(n, buddy_group(p, me, right, st.layout.generation), st);
    st.buddy_in = pair_comm(n, buddy_group(left_pos, left, me, st.layout.generation), st);
    st.buddy_generation = st.layout.generation;
  }
  ctx.set_activity(fmt::format("replicating step {} to rank {}", r.step, right));
  std::int64_t mine[3] = {s.params.numel(), s.m.numel(), s.v.numel()}, theirs[3] = {0, 0, 0};
  auto ws = st.buddy_out->send(mine, 3, dtype::i64, 1);
  auto wr = st.buddy_in->recv(theirs, 3, dtype::i64, 0);
  ws.wait();
  wr.wait();
  owned_tensor* in[3] = {&st.staging.params, &st.staging.m, &st.staging.v};
  const tensor* out[3] = {&s.params, &s.m, &s.v};
  std::vector<collective::work> works;
  std::int64_t bytes = 0;
  for (int i = 0; i < 3; ++i) {
    TROUPE_CHECK(theirs[i] >= 0 && theirs[i] < (std::int64_t{1} << 40), ctx.name(), ": rank ", left,
                 " announced a piece of ", theirs[i], " elements");
    if (!in[i]->view().defined() || in[i]->view().numel() != theirs[i]) *in[i] = empty({theirs[i]});
    works.push_back(
        st.buddy_out->send(out[i]->data(), static_cast<std::size_t>(mine[i]), dtype::f32, 1));
    works.push_back(st.buddy_in->recv(in[i]->view().data(), static_cast<std::size_t>(theirs[i]),
                                      dtype::f32, 0));
    bytes += mine[i] * 4;
    if (i == 0 && chaos_due(st, me, r.step - 1, "replicate")) {
      // The drill: the parameters went (and came), the moments not yet.
      works[0].wait();
      works[1].wait();
      chaos_kill_now(me, r.step - 1, "replicate");
    }
  }
  for (auto& w : works) w.wait();
  st.staging.steps = r.step;
  ctx.set_activity("idle");
  return {bytes};
}

// Elastic recovery on one rank: survivors put the next generation's communicators under their
// piece and take steps again; a promoted spare builds the lost rank's piece; the donor of each
// replaced position sends the piece's parameters and AdamW moments to its spare over UCX.
// Takes the layout of a recovery, a shrink or a reload: the grid positions, the spares and the
// generation, reported as the elastic.generation metric.
void adopt_layout(role_context& ctx, trainer_state& st, const std::vector<int>& positions,
                  const std::vector<int>& spares, int generation) {
  {
    std::lock_guard lk(st.layout_mu);
    st.layout.positions = positions;
    st.layout.spares = spares;
    st.layout.generation = generation;
  }
  ctx.set_metric("elastic.generation", generation);
}

recover_reply recover(role_context& ctx, trainer_state& st, const recover_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.grid && st.elastic, ctx.name(), ": recovery of a trainer not set up elastic");
  // A spare is told of no recovery it takes no part in: it may skip generations.
  TROUPE_CHECK(r.generation == st.layout.generation + 1 ||
                   (!st.hybrid && r.generation > st.layout.generation),
               ctx.name(), ": asked to recover into generation ", r.generation, " from generation ",
               st.layout.generation);
  const auto t0 = std::chrono::steady_clock::now();
  node& n = ctx.node();
  const int me = n.rank();
  adopt_layout(ctx, st, r.positions, r.spares, r.generation);
  const int position = st.layout.position_of(me);
  TROUPE_CHECK(position >= 0, ctx.name(), ": asked to recover, but it holds no grid position");
  ctx.set_activity(fmt::format("recovering (generation {})", r.generation));
  std::string what;
  bind_comms(ctx, st, position);
  if (st.hybrid) {
    st.hybrid->revive();
    st.broken.clear();
    what = "survivor";
    // ZeRO 1 and 2: the shard becomes the parameters' copy of record on every rank (a restored or
    // rolled-back shard is written below), and the next step gathers them from the shards.
    (void)st.hybrid->state();
    if (st.hybrid->steps_done() != r.steps) {
      // Buddy replicas: back to this rank's own snapshot of the last replicated step.
      TROUPE_CHECK(st.own.steps == r.steps, ctx.name(), ": it has done ", st.hybrid->steps_done(),
                   " steps and holds a snapshot of step ", st.own.steps,
                   ", the job goes on from step ", r.steps);
      const auto s = st.hybrid->state();
      ops::copy(st.own.params.view(), s.params.reshape({s.params.numel()}));
      ops::copy(st.own.m.view(), s.m.reshape({s.m.numel()}));
      ops::copy(st.own.v.view(), s.v.reshape({s.v.numel()}));
      st.hybrid->set_progress(st.own.steps, st.own.optimizer_steps);
      what = fmt::format("survivor, back to its snapshot of step {}", r.steps);
    }
  } else {
    set_mesh_of(ctx, st, position);
    ctx.set_metric("elastic.spare", 0);
    // Its weights come from the donor: the piece starts from the init (no checkpoint read).
    auto cfg = st.cfg;
    cfg.resume.clear();
    cfg.model_hf.clear();
    st.hybrid = std::make_unique<mp::hybrid_trainer>(st.model, cfg, groups_of(st));
    (void)st.hybrid->state();  // as the survivors: its shard is received below
    ctx.set_metric("parameters", static_cast<double>(st.hybrid->parameters()));
    what = "promoted spare";
  }
  std::int64_t bytes = 0;
  for (std::size_t k = 0; k < r.move_position.size(); ++k) {
    const int donor = r.move_donor[k], spare = r.move_spare[k];
    if (me != donor && me != spare) continue;
    const auto s = st.hybrid->state();
    const bool from_buddy = r.move_buddy.size() > k && r.move_buddy[k] != 0;
    TROUPE_CHECK(s.whole_optimizer || from_buddy, ctx.name(),
                 ": the piece's optimizer state is a ZeRO shard; a data-parallel replica restores ",
                 "whole pieces (parallel.zero 0) only, a shard comes from a buddy replica");
    std::array<tensor, 3> parts = {s.params, s.m, s.v};
    if (from_buddy && me == donor) {
      TROUPE_CHECK(st.buddy.steps == r.steps, ctx.name(), ": its buddy replica of rank ", spare,
                   "'s position is of step ", st.buddy.steps, ", not ", r.steps);
      parts = {st.buddy.params.view(), st.buddy.m.view(), st.buddy.v.view()};
    }
    bytes += move_state(n, st, restore_group(r.move_position[k], donor, spare, r.generation),
                        me == donor, parts, ctx.name());
    if (me == spare) {
      st.hybrid->set_progress(r.steps, r.optimizer_steps);
      what = fmt::format("promoted spare, state from rank {}{}", donor,
                         from_buddy ? "'s buddy replica" : "");
    } else {
      what = fmt::format("survivor, sent its state to rank {}", spare);
    }
  }
  ctx.set_activity("idle");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {
      fmt::format("rank {}: {} {}, {} at generation {} ({:.3f} s)", me,
                  coordinates(*st.grid, position), st.hybrid->describe(), what, r.generation, secs),
      bytes};
}

// Elastic shrinking on one rank (see shrink_request). ZeRO 0 only (plan_shrink refuses others):
// a survivor's piece state is the whole piece's parameters and AdamW moments, equal on every
// data-parallel replica, so the new piece takes this rank's own copy; nothing moves between ranks.
// ZeRO 1-3 at a shrink: the whole piece's parameters, m and v of the last replicated step, put
// together on every survivor from the shards (its own snapshot, or the buddy replica it holds of
// a lost rank's), each old dp rank's broadcast by the survivor holding it.
struct whole_state {
  owned_tensor params, m, v;
  std::int64_t bytes = 0;
};
whole_state gather_shards(node& n, trainer_state& st, const shrink_request& r) {
  const auto& buckets = st.hybrid->shard_buckets();
  const int old_dp = static_cast<int>(r.old_positions.size());
  auto is_lost = [&](int q) { return std::find(r.lost.begin(), r.lost.end(), q) != r.lost.end(); };
  std::vector<int> survivors;
  for (int q : r.old_positions)
    if (!is_lost(q)) survivors.push_back(q);
  std::sort(survivors.begin(), survivors.end());
  auto c = collective::make_communicator(n.transport(), reshard_group(survivors, r.generation),
                                         "ucx:reshard");
  c->set_timeout(std::chrono::milliseconds(
      static_cast<std::int64_t>(st.cfg.collective_timeout * 1000.0 + 0.5)));
  std::int64_t whole = 0, shard = 0;
  for (const auto& b : buckets) {
    whole = std::max(whole, b.begin + b.length);
    shard = std::max(shard, b.shard_offset + b.chunk);
  }
  TROUPE_CHECK(st.own.steps == r.steps && st.own.params.view().numel() == shard, "rank ", n.rank(),
               ": its snapshot is of step ", st.own.steps, " with ", st.own.params.view().numel(),
               " elements; the shrink goes on from step ", r.steps, " with shards of ", shard);
  whole_state out;
  out.params = empty({whole});
  out.m = empty({whole});
  out.v = empty({whole});
  owned_tensor buf = empty({3 * shard});
  float* b3 = buf.view().data_as<float>();
  for (int d = 0; d < old_dp; ++d) {
    const int holder_pos =
        is_lost(r.old_positions[static_cast<std::size_t>(d)]) ? buddy_holder(d, old_dp) : d;
    const int holder = r.old_positions[static_cast<std::size_t>(holder_pos)];
    const int root =
        static_cast<int>(std::find(survivors.begin(), survivors.end(), holder) - survivors.begin());
    if (holder == n.rank()) {
      const auto& from = holder_pos == d ? st.own : st.buddy;
      TROUPE_CHECK(from.steps == r.steps && from.params.view().numel() == shard, "rank ", n.rank(),
                   ": its copy of dp rank ", d, "'s shard is of step ", from.steps, ", not ",
                   r.steps);
      std::copy_n(from.params.view().data_as<float>(), shard, b3);
      std::copy_n(from.m.view().data_as<float>(), shard, b3 + shard);
      std::copy_n(from.v.view().data_as<float>(), shard, b3 + 2 * shard);
    }
    collective::options o;
    o.root = root;
    c->broadcast(b3, static_cast<std::size_t>(3 * shard), dtype::f32, o).wait();
    out.bytes += 3 * shard * 4;
    float* w[3] = {out.params.view().data_as<float>(), out.m.view().data_as<float>(),
                   out.v.view().data_as<float>()};
    for (const auto& b : buckets) {
      const std::int64_t first = static_cast<std::int64_t>(d) * b.chunk;
      const std::int64_t count = std::clamp<std::int64_t>(b.length - first, 0, b.chunk);
      for (int k = 0; k < 3; ++k)
        std::copy_n(b3 + k * shard + b.shard_offset, count, w[k] + b.begin + first);
    }
  }
  return out;
}

// The new shard of this rank (dp rank `d` of the new grid) taken from the whole state.
void take_shard(trainer_state& st, const whole_state& w, int d) {
  const auto s = st.hybrid->state();
  const tensor* to[3] = {&s.params, &s.m, &s.v};
  const owned_tensor* from[3] = {&w.params, &w.m, &w.v};
  for (const auto& b : st.hybrid->shard_buckets()) {
    const std::int64_t first = static_cast<std::int64_t>(d) * b.chunk;
    const std::int64_t count = std::clamp<std::int64_t>(b.length - first, 0, b.chunk);
    for (int k = 0; k < 3; ++k)
      std::copy_n(from[k]->view().data_as<float>() + b.begin + first, count,
                  to[k]->data_as<float>() + b.shard_offset);
  }
}

// Elastic shrinking on one rank (see shrink_request). ZeRO 0: a survivor's piece state is the
// whole piece's parameters and AdamW moments, equal on every data-parallel replica, so the new
// piece takes this rank's own copy and nothing moves between ranks. ZeRO 1-3: the whole state is
// put together from the shards of the last replicated step (gather_shards) and resharded.
recover_reply shrink(role_context& ctx, trainer_state& st, const shrink_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.grid && st.elastic, ctx.name(), ": shrinking a trainer not set up elastic");
  const auto t0 = std::chrono::steady_clock::now();
  node& n = ctx.node();
  const int me = n.rank();
  TROUPE_CHECK(takes_generation(st.layout, me, r.generation), ctx.name(),
               ": asked to shrink into generation ", r.generation, " from generation ",
               st.layout.generation);
  const bool reshard = !r.old_positions.empty();
  // The state this rank brings: ZeRO 0 its piece's, ZeRO 1-3 the whole one.
  trainer_state::snapshot mine;
  whole_state whole;
  if (st.hybrid) {
    TROUPE_CHECK(reshard || st.hybrid->steps_done() == r.steps, ctx.name(), ": it has done ",
                 st.hybrid->steps_done(), " steps, the job goes on from step ", r.steps);
    st.hybrid->revive();
    if (reshard) {
      ctx.set_activity(fmt::format("resharding the ZeRO-{} state of step {} onto dp{}",
                                   st.cfg.plan.zero, r.steps, r.dp));
      whole = gather_shards(n, st, r);
    } else {
      const auto s = st.hybrid->state();
      TROUPE_CHECK(s.whole_optimizer, ctx.name(),
                   ": its optimizer state is a ZeRO shard; shrinking it needs buddy replicas");
      keep(s.params, mine.params);
      keep(s.m, mine.m);
      keep(s.v, mine.v);
    }
  }
  st.cfg.plan.dp = r.dp;
  st.cfg.plan.microbatches = r.microbatches;
  st.grid = std::make_unique<collective::rank_grid>(with_dp(*st.grid, r.dp));
  adopt_layout(ctx, st, r.positions, r.spares, r.generation);
  ctx.set_metric("elastic.dp", r.dp);
  // Buddy replicas of the old grid are of no use in the new one: the next round makes them again.
  st.own = {};
  st.buddy = {};
  st.staging = {};
  st.buddy_out.reset();
  st.buddy_in.reset();
  st.buddy_generation = -1;
  const int position = st.layout.position_of(me);
  if (position < 0) {
    st.hybrid.reset();
    st.broken.clear();
    const char* change = r.move_spare.empty() ? "shrink" : "growth";
    ctx.set_activity(fmt::format("spare: idle since the {} to {} (generation {})", change,
                                 plan_text(*st.grid), r.generation));
    ctx.set_metric("elastic.spare", 1);
    return {fmt::format("rank {}: spare since the {} to {}", me, change, plan_text(*st.grid)),
            whole.bytes};
  }
  const bool promoted =
      std::find(r.move_spare.begin(), r.move_spare.end(), me) != r.move_spare.end();
  TROUPE_CHECK(st.hybrid || promoted, ctx.name(), ": asked to hold a position of the plan ",
               plan_text(*st.grid), ", but it holds no piece (a spare) and no rank sends it one");
  ctx.set_activity(fmt::format("{} to {} (generation {})",
                               r.move_spare.empty() ? "shrinking" : "growing", plan_text(*st.grid),
                               r.generation));
  bind_comms(ctx, st, position, true);
  st.hybrid.reset();
  auto cfg = st.cfg;  // its weights are the old piece's: no checkpoint read
  cfg.resume.clear();
  cfg.model_hf.clear();
  st.hybrid = std::make_unique<mp::hybrid_trainer>(st.model, cfg, groups_of(st));
  std::string what = reshard ? "its new shard of the whole state" : "its own state";
  if (reshard) {
    take_shard(st, whole, st.grid->coord(position, "dp"));
  } else if (promoted) {
    (void)st.hybrid->state();  // received below
    set_mesh_of(ctx, st, position);
    ctx.set_metric("elastic.spare", 0);
    ctx.set_metric("parameters", static_cast<double>(st.hybrid->parameters()));
  } else {
    const auto s = st.hybrid->state();
    TROUPE_CHECK(s.params.numel() == mine.params.view().numel() &&
                     s.m.numel() == mine.m.view().numel() && s.v.numel() == mine.v.view().numel(),
                 ctx.name(), ": the piece under ", plan_text(*st.grid), " holds ", s.params.numel(),
                 " parameters, under the old plan ", mine.params.view().numel());
    ops::copy(mine.params.view(), s.params.reshape({s.params.numel()}));
    ops::copy(mine.m.view(), s.m.reshape({s.m.numel()}));
    ops::copy(mine.v.view(), s.v.reshape({s.v.numel()}));
  }
  // Growing: each new replica's state from its piece's dp 0 holder (ZeRO 0: the whole piece's
  // parameters and AdamW moments, bitwise), as a recovery restores a spare.
  std::int64_t bytes = whole.bytes;
  for (std::size_t k = 0; k < r.move_spare.size(); ++k) {
    const int donor = r.move_donor[k], spare = r.move_spare[k];
    if (me != donor && me != spare) continue;
    const auto s = st.hybrid->state();
    TROUPE_CHECK(s.whole_optimizer, ctx.name(),
                 ": growing needs whole piece states (parallel.zero 0) on the replicas");
    bytes += move_state(n, st, restore_group(r.move_position[k], donor, spare, r.generation),
                        me == donor, {s.params, s.m, s.v}, ctx.name());
    what = me == spare ? fmt::format("a new replica, its state from rank {}", donor)
                       : fmt::format("its own state, sent to rank {}", spare);
  }
  st.hybrid->set_progress(r.steps, r.optimizer_steps);
  st.broken.clear();
  set_mesh_of(ctx, st, position);
  ctx.set_activity("idle");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {fmt::format("rank {}: {} {}, {} under {} at generation {} ({:.3f} s)", me,
                      coordinates(*st.grid, position), st.hybrid->describe(), what,
                      plan_text(*st.grid), r.generation, secs),
          bytes};
}

// The disk fallback on one rank (reload_request): the next generation's layout and communicators,
// the piece built again from the checkpoint (a survivor drops its own; a spare builds the lost
// one), no buddy replicas until the driver makes them again.
recover_reply reload(role_context& ctx, trainer_state& st, const reload_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.grid && st.elastic, ctx.name(), ": reload of a trainer not set up elastic");
  // Not necessarily the next: a recovery from the survivors may have been under way when a
  // further loss left no copy of a piece.
  TROUPE_CHECK(r.generation > st.layout.generation, ctx.name(), ": asked to reload into ",
               "generation ", r.generation, " from generation ", st.layout.generation);
  const auto t0 = std::chrono::steady_clock::now();
  node& n = ctx.node();
  const int me = n.rank();
  adopt_layout(ctx, st, r.positions, r.spares, r.generation);
  st.own = {};
  st.buddy = {};
  st.staging = {};
  const int position = st.layout.position_of(me);
  if (position < 0) {  // a spare (again): holds no piece
    st.hybrid.reset();
    st.broken.clear();
    ctx.set_activity("spare: idle until a rank is lost");
    return {fmt::format("rank {}: spare at generation {}", me, r.generation), 0};
  }
  ctx.set_activity(
      fmt::format("loading the checkpoint of step {} (generation {})", r.steps, r.generation));
  const bool survivor = st.hybrid != nullptr;
  bind_comms(ctx, st, position);
  set_mesh_of(ctx, st, position);
  ctx.set_metric("elastic.spare", 0);
  st.hybrid.reset();  // its layers hold the rebindable communicators, which stay
  auto cfg = st.cfg;
  cfg.resume = r.dir;
  cfg.model_hf.clear();
  st.hybrid = std::make_unique<mp::hybrid_trainer>(st.model, cfg, groups_of(st));
  st.broken.clear();
  TROUPE_CHECK(st.hybrid->steps_done() == r.steps, ctx.name(), ": the checkpoint in ", r.dir,
               " holds step ", st.hybrid->steps_done(), ", the driver expected step ", r.steps);
  ctx.set_metric("parameters", static_cast<double>(st.hybrid->parameters()));
  ctx.set_activity("idle");
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {fmt::format("rank {}: {} {}, {} from the checkpoint of step {} at generation {} ({:.3f} "
                      "s)",
                      me, coordinates(*st.grid, position), st.hybrid->describe(),
                      survivor ? "survivor, rebuilt" : "promoted spare, built", r.steps,
                      r.generation, secs),
          0};
}

save_reply salvage(role_context& ctx, trainer_state& st, const salvage_request& r) {
  std::lock_guard lk(st.mu);
  TROUPE_CHECK(st.hybrid && st.elastic, ctx.name(), ": nothing to save");
  {
    std::lock_guard lk2(st.layout_mu);
    st.layout.generation = r.generation;
  }
  node& n = ctx.node();
  const int position = st.layout.position_of(n.rank());
  ctx.set_activity("saving the last committed step");
  for (std::size_t i = 0; i < 4; ++i) {
    auto g = elastic_group(*st.grid, st.layout, position, group_axes(i));
    if (i == 0) g.ranks = {n.rank()};  // dp: the replica saves alone
    auto c = collective::make_communicator(n.transport(), g, std::string("ucx:") + group_labels[i]);
    c->set_timeout(std::chrono::milliseconds(
        static_cast<std::int64_t>(st.cfg.collective_timeout * 1000.0 + 0.5)));
    st.comms[i]->rebind(std::move(c), true);
    st.watches[i] = ctx.watch(*st.comms[i]);
  }
  st.hybrid->revive();
  st.broken.clear();
  save_reply out;
  out.written = st.hybrid->save(r.dir);
  ctx.set_activity("idle");
  return out;
}

void add_role(role_registry& roles, std::shared_ptr<const trainer_samples> post) {
  add_expert_group_role(roles);
  roles.add("trainer", [post](role_builder& b, role_context&) {
    auto st = std::make_shared<trainer_state>();
    st->post = post;
    b.on<setup_request>([st](role_context& c, const setup_request& r) { return setup(c, st, r); });
    b.on<step_request>(
        [st](role_context& c, const step_request& r) { return run_step(c, *st, r); });
    b.on<commit_request>(
        [st](role_context& c, const commit_request& r) { return commit_step(c, *st, r); });
    b.on<status_request>([st](role_context& c, const status_request&) { return status(c, *st); });
    b.on<replicate_request>(
        [st](role_context& c, const replicate_request& r) { return replicate(c, *st, r); });
    b.on<salvage_request>(
        [st](role_context& c, const salvage_request& r) { return salvage(c, *st, r); });
    b.on<recover_request>(
        [st](role_context& c, const recover_request& r) { return recover(c, *st, r); });
    b.on<shrink_request>(
        [st](role_context& c, const shrink_request& r) { return shrink(c, *st, r); });
    b.on<reload_request>(
        [st](role_context& c, const reload_request& r) { return reload(c, *st, r); });
    b.on_stop([st](role_context& c) {
      if (st->membership_callback >= 0)
        c.node().remove_membership_callback(st->membership_callback);
      st->membership_callback = -1;
    });
    b.on<save_request>([st](role_context& c, const save_request& r) { return save(c, *st, r); });
    b.on<memory_request>(
        [st](role_context& c, const memory_request&) { return memory_line(c, *st); });
  });
}

}  // namespace

void add_trainer_role(role_registry& roles) {
  add_role(roles, nullptr);
}

void add_trainer_role(role_registry& roles, trainer_samples samples) {
  add_role(roles, std::make_shared<const trainer_samples>(std::move(samples)));
}

namespace {

// The ranks of `layout` (positions and spares) that are not members in good standing any more,
// waited for up to `bound` after a failed step: its error may reach the driver before the loss
// that caused it does.
std::vector<int> lost_ranks(node& n, const elastic_layout& layout,
                            std::chrono::milliseconds bound) {
  auto gone = [&] {
    std::vector<int> out;
    for (int r : layout.positions)
      if (!n.lost_reason(r).empty()) out.push_back(r);
    for (int r : layout.spares)
      if (!n.lost_reason(r).empty()) out.push_back(r);
    return out;
  };
  struct waiter {
    std::mutex mu;
    std::condition_variable cv;
    int changes = 0;
  };
  auto w = std::make_shared<waiter>();
  const int id = n.on_membership([w](const member_event&) {
    std::lock_guard lk(w->mu);
    ++w->changes;
    w->cv.notify_all();
  });
  std::vector<int> out = gone();
  const auto deadline = std::chrono::steady_clock::now() + bound;
  while (out.empty()) {
    std::unique_lock lk(w->mu);
    const int seen = w->changes;
    if (!w->cv.wait_until(lk, deadline, [&] { return w->changes != seen; })) {
      lk.unlock();
      out = gone();
      break;
    }
    lk.unlock();
    out = gone();
  }
  n.remove_membership_callback(id);
  return out;
}

}  // namespace

training_summary drive_training(node& n, const models::train_config& cfg, const drive_options& o) {
  cfg.validate();
  job j(n);
  auto trainers = j.spawn_on_all("trainer");
  TROUPE_CHECK(static_cast<int>(trainers.size()) == n.world_size(), "drive_training: spawned ",
               trainers.size(), " trainers in a job of ", n.world_size(), " ranks");
  const bool elastic = cfg.elastic();
  const int positions = cfg.plan.world_size();
  TROUPE_CHECK(positions + (elastic ? cfg.elastic_spares : 0) == n.world_size(),
               "parallel.dp x parallel.pp x parallel.tp = ", positions,
               elastic && cfg.elastic_spares > 0
                   ? fmt::format(" plus elastic.spares {}", cfg.elastic_spares)
                   : std::string(),
               " but the job has ", n.world_size(), " ranks");
  TROUPE_CHECK(!elastic || cfg.plan.ep == 1, "elastic.* (--elastic) with parallel.ep (--ep) ",
               cfg.plan.ep, ": elastic runs do not restore expert-parallel pieces yet");
  // With pp > 1 the trainer checks the rest (hybrid_trainer: ep = dp, ZeRO 0, f32).
  TROUPE_CHECK(cfg.plan.ep == 1 || (cfg.plan.cp == 1 && cfg.plan.tp == 1), "parallel.ep (--ep) ",
               cfg.plan.ep, " with parallel.cp (--cp) ", cfg.plan.cp, " and parallel.tp (--tp) ",
               cfg.plan.tp, ": expert parallelism runs with cp = tp = 1 so far");
  elastic_layout layout = elastic_layout::initial(positions, n.world_size());
  // Joiners (troupe launch --join): heard of from the membership, admitted as spares.
  std::optional<joiner_watch> joiners;
  if (elastic) joiners.emplace(n);
  TROUPE_CHECK(elastic || o.policy_role.empty(), "drive_training: an elastic policy (",
               o.policy_role, ") needs an elastic run (elastic.enabled)");
  // A custom policy (drive_options::policy_role): its actor on this rank, asked at each event.
  std::optional<role_handle> policy_actor;
  if (!o.policy_role.empty()) policy_actor = j.spawn(o.policy_role, n.rank());
  auto ask_policy = [&](elastic_event e) -> elastic_decision {
    auto d = j.ask<elastic_decision>(*policy_actor, e, std::chrono::minutes(1));
    TROUPE_CHECK((e.what == "lost" && (d.action == "wait" || d.action == "shrink" ||
                                       d.action == "end" || d.action == "default")) ||
                     (e.what == "joined" &&
                      (d.action == "grow" || d.action == "stay" || d.action == "default")) ||
                     e.what == "recovered",
                 "elastic policy ", o.policy_role, ": '", d.action, "' is no decision for a '",
                 e.what, "' event (actors/elastic_policy.hpp)");
    TROUPE_CHECK(d.action != "wait" || (d.wait_s >= 0 && d.wait_s <= 1e6), "elastic policy ",
                 o.policy_role, ": wait ", d.wait_s, " s is not a wait in [0, 1e6] s");
    return d;
  };
  // The trainers holding the grid positions, in position order.
  auto active = [&] {
    std::vector<role_handle> out;
    for (int r : layout.positions) out.push_back(trainers[static_cast<std::size_t>(r)]);
    return out;
  };
  training_summary sum;
  setup_request setup{
      models::to_toml(cfg), elastic ? layout.positions : std::vector<int>{}, {}, {}, {}, 0, -1};
  // Expert parallelism: an expert-group actor beside each trainer, told its load every step.
  std::vector<role_handle> expert_groups;
  if (cfg.plan.ep > 1) expert_groups = j.spawn_on_all("expert-group");
  for (const auto& e : expert_groups) {
    setup.expert_names.push_back(e.name);
    setup.expert_channels.push_back(e.channel);
  }
  auto stop_all = [&] {
    for (const auto& t : trainers) j.stop(t);
    for (const auto& e : expert_groups) j.stop(e);
    if (policy_actor) j.stop(*policy_actor);
  };
  auto lines = j.ask_all<setup_reply>(trainers, setup, std::chrono::minutes(5));
  for (auto& l : lines) sum.ranks.push_back(l.line);
  const std::int64_t resumed = lines.front().step;  // checkpoint.resume: the step to go on from
  for (auto& l : lines)
    TROUPE_CHECK(l.step == resumed || l.step == -1,
                 "drive_training: the trainers resumed at different steps (", resumed, " and ",
                 l.step, ")");
  if (o.on_setup) o.on_setup(sum.ranks);
  // A stuck collective fails on the ranks that wait for it at its deadline, with the text that
  // names the ranks: the driver waits longer than that, so its own timeout does not come first.
  auto step_wait = o.step_timeout;
  if (cfg.collective_timeout > 0)
    step_wait = std::max(step_wait, std::chrono::milliseconds(static_cast<std::int64_t>(
                                        cfg.collective_timeout * 2000.0 + 60000.0)));
  collective::rank_grid grid(grid_axes_of(cfg.plan));  // shrinking lowers its dp
  step_report rep;                                     // the last step's
  auto report_of = [&](const std::vector<step_reply>& replies) {
    rep = {};
    const auto& first = replies.front();
    rep.result.step = first.step;
    rep.result.loss = first.loss;
    rep.result.grad_norm = first.grad_norm;
    rep.result.lr = first.lr;
    rep.result.tokens = first.tokens;
    rep.result.loss_scale = first.loss_scale;
    rep.result.skipped = first.skipped;
    for (const auto& r : replies) {
      rep.result.seconds = std::max(rep.result.seconds, r.seconds);
      rep.bubble = std::max(rep.bubble, r.bubble);
      rep.comm_wait = std::max(rep.comm_wait, r.comm_wait);
      rep.all_to_all = std::max(rep.all_to_all, r.all_to_all);
    }
    return rep.result;
  };
  auto say = [&](const std::string& line) {
    if (o.on_recovery) o.on_recovery(line);
    // A done recovery, shrink or growth: the policy hears of it (its decision is not used).
    if (policy_actor && (line.find("recovery took") != std::string::npos ||
                         line.find("growing took") != std::string::npos)) {
      elastic_event e;
      e.what = "recovered";
      e.ranks = layout.positions;
      e.plan = plan_text(grid);
      e.spares = static_cast<std::int32_t>(layout.spares.size());
      e.detail = line;
      (void)ask_policy(e);
    }
    try {  // the job's event log (introspection); the recovery itself does not depend on it
      n.note_event("recovery", line);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "troupe: %s\n", e.what());
    }
  };
  // Elastic recovery after step `step` (0-based) failed in `phase`: the lost ranks, the agreement
  // on the last committed step (`committed` steps done: every survivor must hold it), a spare per
  // lost position, its state from a surviving replica, the next generation's communicators.
  // Throws, naming the lost rank, the step and the last committed step, when it cannot go on.
  std::optional<std::chrono::steady_clock::time_point> failure_seen;
  const int replicas = elastic ? cfg.elastic_replica_interval : 0;
  std::int64_t replica_step = -1;  // the last step every rank's buddy replica holds
  // Shrinking (elastic.min_ranks): the plan's micro-batches now (grid holds its dp) and the new
  // plan's taken by every live rank; the same step goes on (returns the steps done).
  int microbatches = cfg.plan.microbatches;
  auto shrink_onto = [&](const shrink_plan& sh, std::int64_t step, const char* phase,
                         std::int64_t committed, std::int64_t from, std::int64_t optimizer_steps,
                         const std::vector<int>& lost,
                         std::chrono::steady_clock::time_point t0) -> std::int64_t {
    const std::string before = plan_text(grid);
    const int mb_before = microbatches;
    std::string who;
    for (int pos = 0; pos < grid.world_size(); ++pos) {
      const int r = layout.positions[static_cast<std::size_t>(pos)];
      if (sh.next.position_of(r) < 0 &&
          std::find(sh.next.spares.begin(), sh.next.spares.end(), r) == sh.next.spares.end())
        who += fmt::format("{}rank {} ({}: {})", who.empty() ? "" : ", ", r, coordinates(grid, pos),
                           n.lost_reason(r));
    }
    shrink_request req;
    req.generation = sh.next.generation;
    req.positions = sh.next.positions;
    req.spares = sh.next.spares;
    req.dp = sh.dp;
    req.microbatches = sh.microbatches;
    req.steps = from;
    req.optimizer_steps = optimizer_steps;
    if (cfg.plan.zero != 0) {
      req.old_positions = layout.positions;
      req.lost = lost;
    }
    std::vector<role_handle> live;
    for (int r : sh.next.positions) live.push_back(trainers[static_cast<std::size_t>(r)]);
    for (int r : sh.next.spares) live.push_back(trainers[static_cast<std::size_t>(r)]);
    layout = sh.next;
    grid = with_dp(grid, sh.dp);
    microbatches = sh.microbatches;
    std::int64_t bytes = 0;
    for (const auto& rr : j.ask_all<recover_reply>(live, req, step_wait))
      bytes = std::max(bytes, rr.bytes);
    ++sum.recoveries;
    std::string idle;
    for (int r : sh.next.spares) idle += fmt::format("{}{}", idle.empty() ? "" : ", ", r);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    say(fmt::format(
        "elastic: {} lost in step {} ({}); no spare left: shrank {} -> {}, micro-batches per "
        "replica (gradient accumulation) {} -> {}, the global batch of {} samples kept, at "
        "generation {} (membership epoch {}); {} ranks go on ({}), {}; {}; going on from step "
        "{}, {}; recovery took {:.2f} s",
        who, step + 1, phase, before, plan_text(grid), mb_before, microbatches,
        cfg.batch * cfg.grad_accum, layout.generation, n.epoch(), grid.world_size(),
        fmt::format("elastic.min_ranks {}", cfg.elastic_min_ranks),
        idle.empty() ? std::string("none idle") : "idle as spares: rank " + idle,
        cfg.plan.zero == 0
            ? std::string("each piece's state stayed on a survivor (ZeRO 0: no copy)")
            : fmt::format("the ZeRO-{} shards of step {} resharded onto the new dp (the lost "
                          "ones from their buddy replicas; {:.2f} MB over UCX per rank)",
                          cfg.plan.zero, from, bytes / 1e6),
        from,
        from == committed ? std::string("the last committed")
                          : fmt::format("the last replicated (every rank went back from step "
                                        "{}; the steps since run again)",
                                        committed),
        secs));
    return from;
  };
  // Joiners: each new process heard of gets a trainer, set up as a spare of the current layout
  // and plan (`committed` steps done); returns how many were admitted. The arrival time of the
  // last admitted one is kept for the growth's timing line.
  std::optional<std::chrono::steady_clock::time_point> joiner_arrived;
  int joined_rank = -1;
  auto current_cfg = [&] {
    auto c = cfg;
    c.plan.dp = grid.degree("dp");
    c.plan.microbatches = microbatches;
    return c;
  };
  auto admit_joiners = [&](std::int64_t committed) -> int {
    int admitted = 0;
    for (const auto& a : joiners->take()) {
      const int r = a.rank;
      if (!n.lost_reason(r).empty() || r == n.rank() ||
          std::find(layout.spares.begin(), layout.spares.end(), r) != layout.spares.end())
        continue;
      try {
        auto h = j.spawn("trainer", r, {}, std::chrono::seconds(30));
        setup_request js{models::to_toml(current_cfg()),
                         layout.positions,
                         {},
                         {},
                         layout.spares,
                         static_cast<std::int32_t>(layout.generation),
                         committed};
        auto line = j.ask<setup_reply>(h, js, std::chrono::minutes(5)).line;
        trainers[static_cast<std::size_t>(r)] = h;
        layout.spares.push_back(r);
        std::sort(layout.spares.begin(), layout.spares.end());
        ++sum.joiners;
        ++admitted;
        joiner_arrived = a.at;
        joined_rank = r;
        say(
            fmt::format("elastic: a joiner took rank {}'s place in the job after step {} and "
                        "idles as a spare under {} at generation {} (membership epoch {}): {}",
                        r, committed, plan_text(grid), layout.generation, n.epoch(), line));
      } catch (const std::exception& e) {
        say(
            fmt::format("elastic: the joiner at rank {} could not be set up, the run goes on "
                        "without it: {}",
                        r, e.what()));
      }
    }
    return admitted;
  };
  // Growing back at a step boundary (`done` steps committed, every rank there): with spares idle
  // and dp below the plan's, the largest plan they fill (plan_grow), ZeRO 0 only. A failure
  // during it ends the run (not recovered yet).
  std::optional<std::string> grown_to;  // the first step after a growth says how long it took
  bool policy_stays = false;            // the policy said "stay" at the last joiner
  auto grow = [&](std::int64_t done) {
    if (layout.spares.empty() || grid.degree("dp") >= cfg.plan.dp || cfg.plan.zero != 0) return;
    const int multiple =
        cfg.plan.schedule == scheduler::schedule_kind::interleaved ? cfg.plan.pp : 1;
    auto g = plan_grow(grid, grid.degree("dp"), microbatches, layout, cfg.plan.dp, multiple);
    if (!g) return;
    const auto t0 = std::chrono::steady_clock::now();
    const auto status = j.ask<status_reply>(
        trainers[static_cast<std::size_t>(layout.positions.front())], status_request{}, step_wait);
    TROUPE_CHECK(status.steps == done, "elastic: growing after step ", done, ": rank ",
                 layout.positions.front(), " holds step ", status.steps);
    shrink_request req;
    req.generation = g->next.generation;
    req.positions = g->next.positions;
    req.spares = g->next.spares;
    req.dp = g->dp;
    req.microbatches = g->microbatches;
    req.steps = done;
    req.optimizer_steps = status.optimizer_steps;
    std::string moved;
    const auto next_grid = with_dp(grid, g->dp);
    for (const auto& m : g->moves) {
      req.move_position.push_back(m.position);
      req.move_spare.push_back(m.spare);
      req.move_donor.push_back(m.donor);
      moved += fmt::format("{}rank {} took {} (its state from rank {})", moved.empty() ? "" : ", ",
                           m.spare, coordinates(next_grid, m.position), m.donor);
    }
    std::vector<role_handle> live;
    for (int r : g->next.positions) live.push_back(trainers[static_cast<std::size_t>(r)]);
    for (int r : g->next.spares) live.push_back(trainers[static_cast<std::size_t>(r)]);
    const std::string before = plan_text(grid);
    const int mb_before = microbatches;
    layout = g->next;
    grid = next_grid;
    microbatches = g->microbatches;
    replica_step = -1;  // the old grid's replicas are gone: made again before the next step
    std::int64_t bytes = 0;
    for (const auto& rr : j.ask_all<recover_reply>(live, req, step_wait))
      bytes = std::max(bytes, rr.bytes);
    ++sum.growths;
    grown_to = plan_text(grid);
    say(fmt::format(
        "elastic: grew {} -> {} after step {}, micro-batches per replica (gradient accumulation) "
        "{} -> {}, the global batch of {} samples kept, at generation {} (membership epoch {}); "
        "{}; {:.2f} MB over UCX per rank at most; growing took {:.2f} s",
        before, *grown_to, done, mb_before, microbatches, cfg.batch * cfg.grad_accum,
        layout.generation, n.epoch(), moved, bytes / 1e6,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()));
  };
  // The disk fallback's checkpoint: the last save of this run (its step, its folder), else the
  // folder it resumed from.
  std::optional<std::pair<std::int64_t, std::string>> on_disk;
  if (!cfg.resume.empty()) on_disk = std::pair{resumed, cfg.resume};
  // No survivor holds a piece of the lost ranks `lost` of `before` (a rank and its buddy lost
  // together, or no donor): with a checkpoint of a committed step on disk, every rank of a layout
  // with spares in the lost positions loads it and the steps since run again; the steps to go on
  // from. nullopt (the run ends as before) without a checkpoint or enough spares.
  auto from_disk = [&](const elastic_layout& before, const std::vector<int>& lost,
                       std::int64_t step, const char* phase, std::int64_t committed,
                       std::chrono::steady_clock::time_point t0) -> std::optional<std::int64_t> {
    if (!on_disk || on_disk->first > committed) return std::nullopt;
    elastic_layout now = before;
    now.generation = std::max(before.generation, layout.generation);  // a recovery under way
    auto plan = plan_replacement(grid, now, lost);
    if (!plan) return std::nullopt;
    std::string who;
    for (const auto& m : plan->moves)
      who += fmt::format("{}rank {} ({})", who.empty() ? "" : " and ", m.lost,
                         coordinates(grid, m.position));
    const auto [disk_step, dir] = *on_disk;
    layout = plan->next;
    std::vector<role_handle> alive;  // every rank of the new layout, spares too
    for (int r : layout.positions) alive.push_back(trainers[static_cast<std::size_t>(r)]);
    for (int r : layout.spares) alive.push_back(trainers[static_cast<std::size_t>(r)]);
    j.ask_all<recover_reply>(alive,
                             reload_request{static_cast<std::int32_t>(layout.generation),
                                            layout.positions, layout.spares, dir, disk_step},
                             step_wait);
    replica_step = -1;  // made again by the caller
    ++sum.recoveries;
    std::string took;
    for (const auto& m : plan->moves)
      took +=
          fmt::format("{}rank {} took rank {}'s place", took.empty() ? "" : ", ", m.spare, m.lost);
    say(fmt::format(
        "elastic: {} lost in step {} ({}): {}; going back to the checkpoint of step {} in {} (the "
        "last committed step was {}; the steps since run again); {} at generation {} (membership "
        "epoch {}); recovery took {:.2f} s",
        who, step + 1, phase,
        plan->moves.size() > 1 ? "a piece and its copy both lost"
                               : "no survivor holds a copy of its piece",
        disk_step, dir, committed, took, layout.generation, n.epoch(),
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()));
    return disk_step;
  };
  auto recover = [&](std::int64_t step, const char* phase, std::int64_t committed,
                     const std::string& error) -> std::int64_t {
    const auto t0 = std::chrono::steady_clock::now();
    if (!failure_seen) failure_seen = t0;
    const auto lost = lost_ranks(n, layout, std::chrono::seconds(10));
    std::vector<int> lost_positions;
    for (int r : lost)
      if (layout.position_of(r) >= 0) lost_positions.push_back(r);
    if (lost_positions.empty()) throw troupe::error(error);  // a failure that is not a loss
    // Why each was lost, read now: a joiner in its number clears it in the membership.
    std::map<int, std::string> reason;
    for (int r : lost) reason[r] = n.lost_reason(r);
    std::string who;
    for (int r : lost_positions)
      who += fmt::format("{}rank {} ({}: {})", who.empty() ? "" : ", ", r,
                         coordinates(grid, layout.position_of(r)), reason[r]);
    // A rank lost after `lost` was read (during the recovery: a rank and its buddy killed at once,
    // the second seen late) fails the recovery's requests: end naming every lost rank and why no
    // survivor holds a lost piece (both a rank and its buddy), not with the failed request.
    const elastic_layout before = layout;
    auto fail_if_more_lost = [&](const std::exception& e) -> std::optional<std::int64_t> {
      auto all = lost_ranks(n, before, std::chrono::seconds(10));
      if (all.size() <= lost.size()) return std::nullopt;
      auto again = plan_recovery(grid, before, all, cfg.plan.zero, replicas > 0);
      if (!again) {
        if (auto s = from_disk(before, all, step, phase, committed, t0)) return s;
      }
      std::string names;
      for (int r : all) names += fmt::format("{}{}", names.empty() ? "" : ", ", r);
      TROUPE_FAIL(again ? fmt::format("elastic: ranks {} were lost, some during the recovery (not "
                                      "recovered yet)",
                                      names)
                        : again.error_message(),
                  "; lost in step ", step + 1, " (", phase, "); the last committed step is ",
                  committed, " (the recovery failed: ", e.what(), ")");
    };
    // Agreement: every survivor holds the last committed step.
    std::vector<role_handle> survivors;
    for (int r : layout.positions)
      if (std::find(lost.begin(), lost.end(), r) == lost.end())
        survivors.push_back(trainers[static_cast<std::size_t>(r)]);
    std::vector<status_reply> status;
    try {
      status = j.ask_all<status_reply>(survivors, status_request{}, step_wait);
    } catch (const std::exception& e) {
      if (auto s = fail_if_more_lost(e)) return *s;
      throw;
    }
    for (std::size_t i = 0; i < status.size(); ++i)
      TROUPE_CHECK(status[i].steps == committed, "elastic: ", who, " lost in step ", step + 1, " (",
                   phase, "); ", survivors[i].name, " holds step ", status[i].steps,
                   " but the last committed step is ", committed);
    auto plan = plan_recovery(grid, layout, lost, cfg.plan.zero, replicas > 0);
    bool shrink_ok = true;  // a policy may end the run instead
    if (!plan && policy_actor) {
      double waited = 0;  // in the waits the policy asked for
      for (;;) {
        elastic_event e;
        e.what = "lost";
        e.ranks = lost_positions;
        e.step = committed;
        e.plan = plan_text(grid);
        e.spares = static_cast<std::int32_t>(layout.spares.size());
        e.waited = waited;
        const auto d = ask_policy(e);
        if (d.action != "wait") {
          shrink_ok = d.action != "end";
          break;
        }
        say(
            fmt::format("elastic: {} lost in step {} ({}); no spare left: the policy {} waits up "
                        "to {:g} s for a joiner (troupe launch --join)",
                        who, step + 1, phase, o.policy_role, d.wait_s));
        const auto from = std::chrono::steady_clock::now();
        const auto deadline =
            from + std::chrono::milliseconds(static_cast<std::int64_t>(d.wait_s * 1e3));
        while (!plan && joiners->wait_until(deadline)) {
          admit_joiners(committed);
          plan = plan_recovery(grid, layout, lost, cfg.plan.zero, replicas > 0);
        }
        waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - from).count();
        if (plan) break;
      }
    } else if (!plan && cfg.elastic_join_wait > 0) {
      // elastic.join_wait: a joiner may still take the lost place before the run shrinks or ends.
      say(
          fmt::format("elastic: {} lost in step {} ({}); no spare left: waiting up to {:g} s for a "
                      "joiner (troupe launch --join) to take its place (elastic.join_wait)",
                      who, step + 1, phase, cfg.elastic_join_wait));
      const auto deadline =
          std::chrono::steady_clock::now() +
          std::chrono::milliseconds(static_cast<std::int64_t>(cfg.elastic_join_wait * 1000.0));
      while (!plan && joiners->wait_until(deadline)) {
        admit_joiners(committed);
        plan = plan_recovery(grid, layout, lost, cfg.plan.zero, replicas > 0);
      }
      if (!plan)
        say(fmt::format("elastic: no joiner took the place within {:g} s (elastic.join_wait)",
                        cfg.elastic_join_wait));
    }
    std::string no_way = plan ? std::string() : plan.error_message();
    if (!shrink_ok) no_way += fmt::format(" (the elastic policy {} ended the run)", o.policy_role);
    if (!plan && cfg.elastic_min_ranks > 0 && shrink_ok) {
      // elastic.min_ranks: no spare (or no copy) for a lost position - shrink onto the survivors.
      // The interleaved schedule runs micro-batches in multiples of pp (scheduler::validate).
      const int multiple =
          cfg.plan.schedule == scheduler::schedule_kind::interleaved ? cfg.plan.pp : 1;
      auto sh = plan_shrink(grid, grid.degree("dp"), microbatches, layout, lost,
                            cfg.elastic_min_ranks, cfg.plan.zero, replicas > 0, multiple);
      if (sh && cfg.plan.zero != 0) {
        // The shards are put together from the last replicated step: every survivor holds a
        // snapshot of it, and the buddy holders the lost ranks' shards.
        TROUPE_CHECK(replica_step >= 0, "elastic: ", who, " lost in step ", step + 1, " (", phase,
                     "): shrinking a ZeRO state needs a buddy replica, but none was made yet");
        for (std::size_t i = 0; i < status.size(); ++i)
          TROUPE_CHECK(status[i].replica_steps == replica_step, "elastic: ", survivors[i].name,
                       " holds a snapshot of step ", status[i].replica_steps, ", not ",
                       replica_step);
      }
      if (sh)
        return shrink_onto(*sh, step, phase, committed,
                           cfg.plan.zero != 0 ? replica_step : committed,
                           cfg.plan.zero != 0 ? status.front().replica_optimizer_steps
                                              : status.front().optimizer_steps,
                           lost, t0);
      no_way = sh.error_message();
    }
    if (!plan) {
      if (auto s = from_disk(before, lost, step, phase, committed, t0)) return *s;
      // No way on: save the last committed step when one whole data-parallel replica survived
      // (ZeRO 0: it holds the whole state) and there is a checkpoint folder.
      std::string saved = " (no checkpoint of it was written: ";
      int replica = -1;
      for (int d = 0; d < grid.degree("dp") && replica < 0 && cfg.plan.zero == 0; ++d) {
        bool whole = true;
        for (int p = 0; p < grid.world_size(); ++p)
          if (grid.coord(p, "dp") == d &&
              std::find(lost.begin(), lost.end(), layout.positions[p]) != lost.end())
            whole = false;
        if (whole) replica = d;
      }
      if (cfg.ckpt_dir.empty())
        saved += "no checkpoint.dir)";
      else if (replica < 0)
        saved += cfg.plan.zero != 0 ? "ZeRO shards the state)"
                                    : "no whole data-parallel replica survived)";
      if (!cfg.ckpt_dir.empty() && replica >= 0) {
        std::vector<role_handle> savers;
        for (int p = 0; p < grid.world_size(); ++p)
          if (grid.coord(p, "dp") == replica)
            savers.push_back(trainers[static_cast<std::size_t>(layout.positions[p])]);
        try {
          std::string where;
          for (auto& sv :
               j.ask_all<save_reply>(savers, salvage_request{layout.generation + 1, cfg.ckpt_dir},
                                     std::chrono::minutes(5)))
            if (!sv.written.empty()) where = sv.written;
          saved = fmt::format("; its checkpoint is in {}, saved by data-parallel replica {}", where,
                              replica);
          if (o.on_save) o.on_save(committed, where, std::nullopt);
        } catch (const std::exception& e) {
          saved += std::string("saving it failed: ") + e.what() + ")";
        }
      }
      TROUPE_FAIL(no_way, "; lost in step ", step + 1, " (", phase,
                  "); the last committed step is ", committed, saved);
    }
    recover_request req;
    req.generation = plan->next.generation;
    req.positions = plan->next.positions;
    req.spares = plan->next.spares;
    bool buddy = false;
    for (const auto& m : plan->moves) {
      req.move_position.push_back(m.position);
      req.move_spare.push_back(m.spare);
      req.move_donor.push_back(m.donor);
      req.move_buddy.push_back(m.buddy ? 1 : 0);
      buddy = buddy || m.buddy;
    }
    req.steps = committed;
    req.optimizer_steps = status.front().optimizer_steps;
    if (buddy && replica_step != committed) {
      // A piece from a buddy replica is of the last replicated step: every rank goes back there
      // (its own snapshot) and the steps since run again, with the batches they had.
      TROUPE_CHECK(replica_step >= 0, "elastic: ", who, " lost in step ", step + 1, " (", phase,
                   "): its piece is restored from a buddy replica, but none was made yet");
      for (std::size_t i = 0; i < status.size(); ++i)
        TROUPE_CHECK(status[i].replica_steps == replica_step, "elastic: ", survivors[i].name,
                     " holds a snapshot of step ", status[i].replica_steps, ", not ", replica_step);
      req.steps = replica_step;
      req.optimizer_steps = status.front().replica_optimizer_steps;
    }
    layout = plan->next;
    std::vector<recover_reply> replies;
    try {
      replies = j.ask_all<recover_reply>(active(), req, step_wait);
    } catch (const std::exception& e) {
      if (auto s = fail_if_more_lost(e)) return *s;
      throw;
    }
    std::int64_t bytes = 0;
    for (const auto& r : replies) bytes = std::max(bytes, r.bytes);
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    ++sum.recoveries;
    for (const auto& m : plan->moves)
      say(fmt::format(
          "elastic: rank {} ({}) lost in step {} ({}: {}); rank {} took its place at generation "
          "{} (membership epoch {}), {} from rank {} ({}, {:.2f} MB over UCX); going on "
          "from step {}, {}; recovery took {:.2f} s",
          m.lost, coordinates(grid, m.position), step + 1, phase, reason[m.lost], m.spare,
          layout.generation, n.epoch(),
          cfg.plan.zero == 0
              ? std::string("its state")
              : fmt::format("its ZeRO-{} shard (dp rank {} of {}: parameters, m and v)",
                            cfg.plan.zero, grid.coord(m.position, "dp"), grid.degree("dp")),
          m.donor,
          m.buddy ? fmt::format("its buddy replica of step {}", req.steps)
                  : std::string("a data-parallel replica"),
          bytes / 1e6, req.steps,
          req.steps == committed ? std::string("the last committed")
                                 : fmt::format("the last replicated (every rank went back from "
                                               "step {}; the steps since run again)",
                                               committed),
          secs));
    return req.steps;
  };
  // Buddy replicas after `done` steps: exchange, then keep (both on every rank, or a recovery).
  // Returns the steps every rank holds afterwards.
  std::function<std::int64_t(std::int64_t)> replicate = [&](std::int64_t done) -> std::int64_t {
    const auto t0 = std::chrono::steady_clock::now();
    for (std::int32_t phase = 0; phase < 2; ++phase) {
      const auto gen = static_cast<std::int32_t>(layout.generation);
      auto results =
          j.try_ask_all<replicate_reply>(active(), replicate_request{done, gen, phase}, step_wait);
      std::string failed;
      for (auto& r : results) {
        if (!r && failed.empty()) failed = r.error_message();
        if (r) sum.replication_bytes = std::max(sum.replication_bytes, r->bytes);
      }
      if (phase == 1) replica_step = done;  // kept on every live rank (local)
      if (!failed.empty()) {
        const auto at = recover(
            done - 1,
            phase == 0 ? "replicating its state to the buddies" : "keeping the buddy replicas",
            done, failed);
        // The new spare holds no replica yet, nor its buddy its copy: replicate again (also when
        // every rank went back: the spare holds no snapshot of that step).
        return replicate(at);
      }
    }
    ++sum.replications;
    sum.replication_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return done;
  };
  // The launched run's policy on the one loop: a step is every trainer's step (the first rank's
  // loss, the slowest rank's time, the largest bubble and wait), a save every trainer's part of it.
  models::train_policy policy;
  policy.step = [&](std::int64_t s) {
    if (!elastic) return report_of(j.ask_all<step_reply>(active(), step_request{s}, step_wait));
    // Elastic: two phases. No rank applies step s before every rank has prepared it, so a loss
    // before the commit leaves every survivor at step s; the commit is local (zero 1 and 2 gather
    // the updated parameters at the start of the next step), so a loss during it leaves every
    // survivor at step s + 1.
    // Buddy replicas may take every rank back to an earlier step: `at` is the steps done, the
    // steps from there to s run again (their results were reported already).
    if (cfg.elastic_await_join == s + 1) {
      // The drill (elastic.await_join): wait here for a joiner.
      const double wait = cfg.elastic_join_wait > 0 ? cfg.elastic_join_wait : 120.0;
      say(
          fmt::format("elastic: waiting up to {:g} s for a joiner before step {} "
                      "(elastic.await_join)",
                      wait, s + 1));
      TROUPE_CHECK(
          joiners->wait_until(std::chrono::steady_clock::now() +
                              std::chrono::milliseconds(static_cast<std::int64_t>(wait * 1000.0))),
          "elastic.await_join (--await-join) ", cfg.elastic_await_join,
          ": no joiner arrived within ", wait, " s");
    }
    // A step boundary: every rank holds step s. Joiners become spares; a shrunk run grows back.
    const int admitted = admit_joiners(s);
    bool grow_now = admitted > 0 || !layout.spares.empty();
    if (admitted > 0 && policy_actor) {
      elastic_event e;
      e.what = "joined";
      e.ranks = {joined_rank};
      e.step = s;
      e.plan = plan_text(grid);
      e.spares = static_cast<std::int32_t>(layout.spares.size());
      grow_now = ask_policy(e).action != "stay";
      policy_stays = !grow_now;
    }
    if (grow_now && !policy_stays) grow(s);
    std::int64_t at = s;
    if (replicas > 0 && replica_step < 0) at = replicate(s);  // the first: the starting state
    for (;;) {
      const auto gen = static_cast<std::int32_t>(layout.generation);
      try {
        j.ask_all<step_reply>(active(), step_request{at, gen, 1}, step_wait);
      } catch (const std::exception& e) {
        at = recover(at, "forward, backward or the gradient collectives, before its commit", at,
                     e.what());
        // The spare holds no snapshot, nor its buddy a copy of it: replicate now.
        if (replicas > 0) at = replicate(at);
        continue;
      }
      auto results = j.try_ask_all<step_reply>(active(), commit_request{at, gen}, step_wait);
      std::vector<step_reply> ok;
      std::string failed;
      for (auto& r : results) {
        if (r)
          ok.push_back(*r);
        else if (failed.empty())
          failed = r.error_message();
      }
      const std::int64_t ran = at;
      std::int64_t done = at + 1;
      if (!failed.empty()) {
        if (ok.empty()) throw troupe::error(failed);
        done = recover(at, "its commit", at + 1, failed);
        if (replicas > 0) done = replicate(done);
      } else if (replicas > 0 && done % replicas == 0) {
        done = replicate(done);
      }
      at = done;
      if (ran != s || done != s + 1) continue;  // a step run again, or taken back
      auto result = report_of(ok);
      if (grown_to && joiner_arrived) {
        say(fmt::format(
            "elastic: step {} completed on {} {:.2f} s after the joiner at rank {} "
            "arrived",
            s + 1, *grown_to,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - *joiner_arrived)
                .count(),
            joined_rank));
        grown_to.reset();
        joiner_arrived.reset();
      }
      grown_to.reset();
      if (failure_seen) {
        say(fmt::format(
            "elastic: step {} completed {:.2f} s after the failure was seen", s + 1,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - *failure_seen)
                .count()));
        failure_seen.reset();
      }
      return result;
    }
  };
  policy.save = [&](const std::string& folder) {
    for (auto& sv : j.ask_all<save_reply>(active(), save_request{folder}, std::chrono::minutes(5)))
      if (!sv.written.empty()) sum.checkpoint = sv.written;
  };
  policy.failed = [&](std::exception_ptr, const models::train_progress&) { stop_all(); };
  models::train_hooks hooks;
  hooks.on_step = [&](const models::step_result&) {
    if (o.on_step) o.on_step(rep);
  };
  hooks.on_save = [&](std::int64_t step, const std::string& folder,
                      std::optional<std::int64_t> before) {
    on_disk = std::pair{step, folder};
    if (o.on_save) o.on_save(step, folder, before);
  };
  sum.progress = models::run_train_loop(cfg, resumed, policy, hooks);
  for (auto& m : j.ask_all<memory_reply>(active(), memory_request{}, std::chrono::minutes(1)))
    sum.memory.push_back(m.line);
  stop_all();
  return sum;
}

}  // namespace troupe::actors
