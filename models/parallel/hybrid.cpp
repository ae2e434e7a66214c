// hybrid_trainer (see hybrid.hpp): builds the rank's piece for the plan, then hands it to
// dp_trainer.
#include "models/parallel/hybrid.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <string>
#include <variant>
#include <vector>

#include "memory/error.hpp"
#include "models/families.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/file_io.hpp"
#include "models/hf/training_state.hpp"
#include "models/parallel/context_parallel.hpp"
#include "models/parallel/context_pipeline.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/expert_parallel.hpp"
#include "models/parallel/gpt_stage.hpp"
#include "models/parallel/llama_stage.hpp"
#include "models/parallel/mixed_piece.hpp"
#include "models/parallel/model_producer.hpp"
#include "models/parallel/moe_stage.hpp"
#include "models/parallel/pipeline_runner.hpp"
#include "models/parallel/plan_checkpoint.hpp"
#include "models/parallel/whole_model.hpp"
#include "scheduler/plan.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

namespace {

scheduler::model_shape shape_of(const hf::model_config& m, const train_config& cfg) {
  scheduler::model_shape s = with_family(m, [](auto family, const auto& c) {
    using F = typename decltype(family)::type;
    return tp_parts<F>::shape(c);  // every family has its placement parts (tp_family.hpp)
  });
  s.seq = cfg.seq;
  s.batch = cfg.batch * cfg.grad_accum;
  return s;
}

// "0-1" or "0-1, 4-5" (interleaved chunks).
std::string blocks_of(const pipeline_stage& s) {
  std::string out;
  for (int c = 0; c < s.chunks(); ++c)
    out += fmt::format("{}{}-{}", c ? ", " : "", s.first_block(c), s.end_block(c) - 1);
  return out;
}

// "0-3, 12-15": the runs of positions a context-parallel rank holds.
std::string positions_of(const std::vector<sequence_piece>& pieces) {
  std::string at;
  for (const auto& p : pieces)
    at += fmt::format("{}{}-{}", at.empty() ? "" : ", ", p.start, p.start + p.length - 1);
  return at;
}

const char* cp_mode_label(scheduler::cp_mode_kind m) {
  return m == scheduler::cp_mode_kind::ring ? "ring attention, zigzag" : "Ulysses";
}

int size_of(collective::communicator* c, const char* what) {
  TROUPE_CHECK(c != nullptr, "hybrid_trainer: no ", what, " communicator given");
  return c->size();
}

}  // namespace

struct hybrid_trainer::impl {
  train_config cfg;
  hybrid_groups g;
  std::unique_ptr<causal_lm> model;       // pp == 1: the whole model or its tensor shard
  std::unique_ptr<pipeline_stage> stage;  // pp > 1
  pipeline_runner* runner = nullptr;      // pp > 1: the piece (bf16: the inner one)
  std::unique_ptr<grad_producer> inner;   // bf16: the model's own piece, under `piece`
  std::unique_ptr<grad_producer> piece;
  std::unique_ptr<dp_trainer> dp;
  std::unique_ptr<ep_trainer> ep;  // parallel.ep > 1: the engine instead of dp (no piece)
  // parallel.ep > 1 with parallel.pp > 1: the stage's MoE layers exchange rows over the ep group.
  std::unique_ptr<comm_exchange> stage_exchange;
  std::unique_ptr<whole_model> whole;  // the whole model's description only (no memory)
  piece_layout layout;
  // Checkpoints: the moments' layout (the weights' but for who owns a run of a ZeRO shard) and the
  // groups a save gathers over: the ranks that gather (rank 0 of `gather`) and the group whose
  // parts make a whole model (`parts`): dp and mp, or under ep the edp and ep groups.
  piece_layout moment_layout;
  collective::communicator* gather = nullptr;
  collective::communicator* parts = nullptr;
  std::string description;

  bool ep_pp = false;  // parallel.ep > 1 with parallel.pp > 1: every dp rank holds other experts
  dp_trainer::optimizer_view optimizer_state() const {
    if (ep) return ep->optimizer_state();
    auto v = dp->optimizer_state();
    if (ep_pp) v.whole = false;  // each dp rank writes its own experts' moments
    return v;
  }
  void build_expert_parallel(const hf::model_config& model, bool recompute);
};

// Expert parallelism (expert_parallel.hpp): the rank's experts and everything else whole, trained
// by ep_trainer over the dp, ep and edp groups. Checkpoints gather over edp (its rank 0: the dp
// ranks of the first expert-parallel group) and ep (the parts: each expert on one ep rank, the
// rest counted on ep rank 0).
void hybrid_trainer::impl::build_expert_parallel(const hf::model_config& model, bool recompute) {
  const auto& plan = cfg.plan;
  TROUPE_CHECK(plan.cp == 1, "parallel.ep (--ep) ", plan.ep, " with parallel.cp (--cp) ", plan.cp,
               ": expert and context parallelism do not compose yet");
  TROUPE_CHECK(!cfg.tiers(), "parallel.ep (--ep) ", plan.ep,
               " with memory tiers (--device-memory, --host-memory, --nvme-dir): expert ",
               "parallelism keeps its pieces in host memory only so far");
  TROUPE_CHECK(g.ep != nullptr && g.edp != nullptr && g.ep->size() == plan.ep &&
                   g.edp->size() * plan.ep == plan.dp,
               "hybrid_trainer: parallel.ep ", plan.ep, " needs an ep group of ", plan.ep,
               " ranks and an expert-data-parallel group of parallel.dp / parallel.ep = ",
               plan.dp / plan.ep);
  train_config c = cfg;
  c.recompute = recompute;
  ep = std::make_unique<ep_trainer>(model, c, ep_groups{g.dp, g.ep, g.edp});
  causal_lm& m = ep->model();
  layout.slots = &m.slots();
  layout.base = m.memory().params();
  const int er = g.ep->rank();
  layout.owns = [er](const tensor_slot& s) { return s.spec.expert >= 0 || er == 0; };
  moment_layout = layout;
  // ZeRO 1, 2: every rank's runs are its own chunks (disjoint over dp, or over edp for experts).
  if (plan.zero >= 1) moment_layout.owns = {};
  gather = g.edp;
  parts = g.ep;
  const std::int64_t n = to_moe_config(std::get<hf::moe_config>(model)).n_expert;
  description = fmt::format(
      "experts {}-{} of {} of every MoE layer (ep {} of {}, expert data parallel {} of {}), the "
      "rest whole",
      er * n / plan.ep, (er + 1) * n / plan.ep - 1, n, er, plan.ep, g.edp->rank(), g.edp->size());
  if (recompute) description += ", recompute";
}

hybrid_trainer::hybrid_trainer(const hf::model_config& model, const train_config& cfg,
                               const hybrid_groups& g)
    : impl_(std::make_unique<impl>()), model_(model) {
  auto& I = *impl_;
  I.cfg = cfg;
  I.g = g;
  const auto& plan = cfg.plan;
  const int world = plan.world_size();
  TROUPE_CHECK(size_of(g.dp, "dp") == plan.dp, "hybrid_trainer: parallel.dp is ", plan.dp,
               " but the dp group has ", g.dp->size(), " ranks");
  TROUPE_CHECK(size_of(g.tp, "tp") == plan.tp, "hybrid_trainer: parallel.tp is ", plan.tp,
               " but the tp group has ", g.tp->size(), " ranks");
  TROUPE_CHECK(size_of(g.pp, "pp") == plan.pp, "hybrid_trainer: parallel.pp is ", plan.pp,
               " but the pp group has ", g.pp->size(), " ranks");
  TROUPE_CHECK(size_of(g.mp, "mp") == plan.pp * plan.tp, "hybrid_trainer: the model-parallel ",
               "group has ", g.mp->size(),
               " ranks, not parallel.pp x parallel.tp = ", plan.pp * plan.tp);
  if (plan.cp > 1) {
    TROUPE_CHECK(size_of(g.cp, "cp") == plan.cp, "hybrid_trainer: parallel.cp is ", plan.cp,
                 " but the cp group has ", g.cp->size(), " ranks");
    TROUPE_CHECK(size_of(g.dp_cp, "dp x cp") == plan.dp * plan.cp,
                 "hybrid_trainer: the dp x cp group has ", g.dp_cp->size(),
                 " ranks, not parallel.dp x parallel.cp = ", plan.dp * plan.cp);
    // The piece is the whole model: its gradients are reduced (and ZeRO sharded) over dp x cp,
    // which is the data-parallel group of everything below (the engine, checkpoints, moments).
    I.g.dp = g.dp_cp;
  }
  const scheduler::model_shape shape = shape_of(model, cfg);
  TROUPE_CHECK(plan.ep == 1 || plan.tp == 1, "parallel.ep (--ep) ", plan.ep,
               " with parallel.tp (--tp) ", plan.tp,
               ": expert parallelism runs with tp = 1 (the experts have no tensor-parallel "
               "placement yet)");
  // ep x pp (moe_stage.hpp): each stage's MoE layers over the stage's ep group (ep of its dp
  // ranks), the expert gradients reduced over the stage's edp group only (dp_options::own_experts).
  const bool ep_pp = plan.ep > 1 && plan.pp > 1;
  I.ep_pp = ep_pp;
  if (ep_pp) {
    std::vector<std::string> no;
    if (plan.zero != 0) no.push_back(fmt::format("parallel.zero 0 (got {})", plan.zero));
    if (cfg.precision != "f32") no.push_back("train.precision f32 (got " + cfg.precision + ")");
    if (plan.cp > 1) no.push_back(fmt::format("parallel.cp 1 (got {})", plan.cp));
    if (cfg.tiers()) no.push_back("no memory tiers");
    if (cfg.elastic()) no.push_back("no elastic runs");
    std::string needs;
    for (const auto& n : no) needs += (needs.empty() ? "" : ", ") + n;
    TROUPE_CHECK(no.empty(), "parallel.ep (--ep) ", plan.ep, " with parallel.pp (--pp) ", plan.pp,
                 ": expert parallelism over pipeline stages runs with ", needs, " so far");
    TROUPE_CHECK(g.ep != nullptr && g.edp != nullptr && g.ep->size() == plan.ep &&
                     g.edp->size() * plan.ep == plan.dp,
                 "hybrid_trainer: parallel.ep ", plan.ep, " needs an ep group of ", plan.ep,
                 " ranks and an expert-data-parallel group of parallel.dp / parallel.ep = ",
                 plan.dp / plan.ep);
  }
  TROUPE_CHECK(plan.cp == 1 || plan.pp == 1 || shape.experts == 0, "parallel.cp (--cp) ", plan.cp,
               " with parallel.pp (--pp) ", plan.pp,
               ": the MoE family's pipeline stages do not take context parallelism yet (the router "
               "statistics of the aux loss are not summed over the cp group)");
  // The MoE family's placements are pipeline stages (moe_stage.hpp); its experts are not split
  // over tensor shards.
  TROUPE_CHECK(plan.tp == 1 || shape.experts == 0, "parallel.tp ", plan.tp,
               ": the MoE family has no tensor-parallel placement yet (its experts are not split "
               "over tensor shards; use parallel.tp 1 with parallel.pp, parallel.dp, parallel.ep)");
  // Expert parallelism: an MoE model's, in its own engine (models/parallel/expert_parallel.hpp).
  TROUPE_CHECK(plan.ep == 1 || shape.experts > 0, "parallel.ep (--ep) ", plan.ep,
               " needs an MoE model: this one has no experts");
  auto problems = scheduler::validate(plan, shape, world);
  if (plan.tp > 1 && shape.ffn % plan.tp != 0)
    problems.push_back(fmt::format("parallel.tp = {} does not divide {} = {}", plan.tp,
                                   shape.gated_mlp ? "intermediate_size" : "n_inner", shape.ffn));
  if (plan.zero == 3 && plan.pp > 1)
    problems.push_back("parallel.zero 3 cannot be combined with parallel.pp > 1 (as in DeepSpeed)");
  if (!problems.empty()) throw error(scheduler::join(problems));
  // bf16 and f16: every piece (the whole model, a tensor shard, a pipeline stage or a shard of
  // one) computes in 16 bits under mixed_piece, which gives the engine f32 master weights and
  // gradients; f16 adds the engine's loss scaling with steps skipped on every rank alike.
  const bool bf16 = cfg.precision == "bf16", f16 = cfg.precision == "f16";
  TROUPE_CHECK(cfg.precision == "f32" || bf16 || f16, "train.precision ", cfg.precision,
               ": parallel plans train in f32, bf16 or f16 (the f64 reference is the ",
               "single-process trainer's only)");
  TROUPE_CHECK(!f16 || plan.ep == 1, "train.precision f16 with parallel.ep (--ep) ", plan.ep,
               ": the expert-parallel engine has no loss scaling yet (use bf16)");
  TROUPE_CHECK(!f16 || !cfg.elastic(), "train.precision f16 with elastic runs (--elastic): ",
               "the loss scale is not carried across membership changes yet (use bf16)");
  const dtype compute = bf16 ? dtype::bf16 : f16 ? dtype::f16 : dtype::f32;
  TROUPE_CHECK(plan.recompute != scheduler::recompute_policy::selective,
               "parallel.recompute selective: selective activation checkpointing is not ",
               "available under a parallel plan yet (use full or none)");
  // train.recompute or parallel.recompute full: every piece recomputes (gpt_config::recompute).
  const bool recompute = cfg.recompute || plan.recompute == scheduler::recompute_policy::full;

  const batch_dims dims{dp_trainer::microbatch_rows(cfg), cfg.seq};
  I.whole = std::make_unique<whole_model>(model);
  I.gather = I.g.dp;
  I.parts = g.mp;
  if (plan.ep > 1 && !ep_pp) {
    I.build_expert_parallel(model, recompute);
    const std::string& from = !cfg.resume.empty() ? cfg.resume : cfg.model_hf;
    if (!from.empty())
      load_piece(*I.whole, from, I.layout, I.layout.base);
    else
      init_piece(*I.whole, cfg.seed, I.layout, I.layout.base);
    if (!cfg.resume.empty()) resume(cfg.resume, I.whole->layout());
    return;
  }

  const tp_group tg{plan.tp > 1 ? g.tp : nullptr, plan.sp};
  // The rank's piece of the family (models/families.hpp): its pipeline stage or its tensor shard.
  if (plan.pp > 1 || plan.tp > 1)
    with_family(model, [&](auto family, auto c) {
      using F = typename decltype(family)::type;
      c.recompute = recompute;
      if constexpr (tp_family<F>) {
        if (plan.pp > 1) {
          stage_options o = stage_options::of(plan, g.pp->rank(), shape);
          o.type = compute;
          // Context parallelism inside the stages: each holds seq / cp positions of every sample,
          // positions of the whole sequence, so the whole must fit the model (as cp_piece checks).
          TROUPE_CHECK(
              plan.cp == 1 || dims.seq <= c.max_seq, "context parallelism (parallel.cp = ", plan.cp,
              ") in pipeline stages: train.seq = ", dims.seq, " exceeds the model's max_seq ",
              c.max_seq, " (each stage holds seq / cp positions of the whole sequence)");
          const batch_dims sd{dims.batch, plan.cp > 1 ? dims.seq / plan.cp : dims.seq};
          if constexpr (std::is_same_v<F, moe_family>)
            if (ep_pp) {
              c.ep = plan.ep;
              c.ep_rank = g.ep->rank();
            }
          auto st = std::make_unique<stage<F>>(c, sd, o, tg);
          if constexpr (std::is_same_v<F, moe_family>)
            if (ep_pp) {
              I.stage_exchange = std::make_unique<comm_exchange>(*g.ep);
              set_expert_exchange(*st, I.stage_exchange.get());
            }
          I.stage = std::move(st);
        } else {
          I.model = std::make_unique<causal_lm_of<tp_model<F>>>(c, dims, tg, compute);
        }
      }
    });
  if (plan.pp > 1) {
    auto runner = std::make_unique<pipeline_runner>(*I.stage, *g.pp, plan, g.mp);
    runner->trace_to(cfg.pipe_trace);
    I.runner = runner.get();
    I.description =
        fmt::format("stage {} of {} (blocks {}){}", g.pp->rank(), plan.pp, blocks_of(*I.stage),
                    plan.tp > 1 ? fmt::format(", tensor shard {} of {}{}", g.tp->rank(), plan.tp,
                                              plan.sp ? " (sequence parallel)" : "")
                                : std::string());
    if (plan.cp > 1) {  // context parallelism inside the stage (context_pipeline.hpp)
      auto piece = std::make_unique<cp_pipeline_piece>(std::move(runner), *I.stage, cfg.seq, *g.cp,
                                                       plan.cp_mode);
      I.description += fmt::format(" on positions {} of each sample ({}, cp {} of {})",
                                   positions_of(piece->pieces()), cp_mode_label(plan.cp_mode),
                                   g.cp->rank(), plan.cp);
      I.piece = std::move(piece);
    } else {
      I.piece = std::move(runner);
    }
  } else if (plan.cp > 1) {
    auto piece = std::make_unique<cp_piece>(model, dims.batch, cfg.seq, *g.cp, compute, recompute,
                                            plan.cp_mode);
    I.description = fmt::format("whole model on positions {} of each sample ({}, cp {} of {})",
                                positions_of(piece->pieces()), cp_mode_label(plan.cp_mode),
                                g.cp->rank(), plan.cp);
    I.piece = std::move(piece);
  } else if (plan.tp == 1) {
    I.model = make_causal_lm(model, dims, compute, device::cpu(), {.recompute = recompute});
    I.piece = std::make_unique<model_producer>(*I.model);
    I.description = "whole model";
  } else {
    I.piece = std::make_unique<model_producer>(*I.model, *g.tp);
    I.description = fmt::format("tensor shard {} of {}{}", g.tp->rank(), plan.tp,
                                plan.sp ? " (sequence parallel)" : "");
  }
  if (bf16 || f16) {
    I.inner = std::move(I.piece);
    I.piece = std::make_unique<mixed_piece>(*I.inner);
    I.description += fmt::format(", {} with f32 master weights{}", cfg.precision,
                                 f16 ? " and dynamic loss scaling" : "");
  }
  if (recompute) I.description += ", recompute";
  I.layout.slots = &I.piece->slots();
  I.layout.base = I.piece->memory().params();
  I.layout.tp_rank = g.tp->rank();
  I.layout.tp = plan.tp;
  grad_producer* piece = I.piece.get();
  I.layout.owns = [piece](const tensor_slot& s) { return piece->counts_in_norm(s); };
  if (ep_pp) {  // each expert on its first holder (edp rank 0), the rest on dp rank 0
    const int er = g.ep->rank();
    const bool expert_writer = g.edp->rank() == 0, writer = I.g.dp->rank() == 0;
    I.layout.owns = [piece, expert_writer, writer](const tensor_slot& s) {
      return piece->counts_in_norm(s) && (s.spec.expert >= 0 ? expert_writer : writer);
    };
    const std::int64_t n = shape.experts;
    I.description += fmt::format(
        ", experts {}-{} of {} of every MoE layer (ep {} of {}, expert data parallel {} of {})",
        er * n / plan.ep, (er + 1) * n / plan.ep - 1, n, er, plan.ep, g.edp->rank(), g.edp->size());
  }
  I.moment_layout = I.layout;
  // The piece's weights, one whole parameter at a time: a checkpoint's (checkpoint.resume, else
  // model.hf), or the single-process model's init.
  const std::string& from = !cfg.resume.empty() ? cfg.resume : cfg.model_hf;
  if (!from.empty())
    load_piece(*I.whole, from, I.layout, I.layout.base);
  else
    init_piece(*I.whole, cfg.seed, I.layout, I.layout.base);
  // bf16, f16: fresh weights start rounded, as the single-process trainer's master weights do.
  if (auto* mixed = dynamic_cast<mixed_piece*>(I.piece.get()); mixed && cfg.resume.empty())
    mixed->round_master();
  // parallel.dp_bucket_bytes and parallel.dp_overlap (the default 25 MiB is one bucket for a tiny
  // model, which then cannot overlap with backward).
  dp_options o = dp_options::of(plan);
  if (cfg.tiers()) {  // memory tiers: the ZeRO shard's moments paged (paged_moments.hpp)
    o.moments = moment_tiers_of(cfg, I.g.dp->rank());
    // ZeRO 3: the whole shard (parameters, gradients and moments: paged_shard.hpp).
    I.description += fmt::format(
        ", {} in memory tiers ({}{})",
        plan.zero == 3 && o.page_shard ? "shard (parameters, gradients, optimizer state)"
                                       : "optimizer state",
        memory::tier_name(o.moments->home),
        o.moments->home == memory::tier::nvme ? " in " + o.moments->nvme_dir : std::string());
  }
  // Elastic runs: the optimizer step is the commit point, so ZeRO 1 and 2 gather the updated
  // parameters at the start of the next step instead of in the commit.
  o.defer_gather = cfg.elastic();
  o.own_experts = ep_pp;
  if (ep_pp) {
    o.expert_dp = g.edp;
    o.expert_group = g.ep;
  }
  I.dp = std::make_unique<dp_trainer>(*I.piece, cfg, *I.g.dp, o);
  if (!cfg.resume.empty()) resume(cfg.resume, I.whole->layout());
}

void hybrid_trainer::resume(const std::filesystem::path& folder, const whole_layout& whole) {
  auto& I = *impl_;
  auto file = hf::training_state_file::open(folder, shape{whole.numel}).value();
  // Every rank reads the same file, so every rank fails these checks alike (before any collective).
  check_steps_left(file.state().step, I.cfg, folder.string());
  check_data_position(file.state().extra_json, I.cfg, (folder / "trainer_state.json").string());
  scatter_moments(whole, file.f32_view(file.m()), file.f32_view(file.v()));
  set_progress(file.state().step, file.state().optimizer_steps);
  // f16: the loss scale goes on from an f16 run's checkpoint, the single process's or a plan's.
  if (auto* s = I.dp ? I.dp->scaler() : nullptr; s != nullptr)
    s->resume_from(file.state().extra_json);
}

void hybrid_trainer::gather_moments(const whole_layout& whole, const tensor& m, const tensor& v) {
  auto& I = *impl_;
  parallel::gather_moments(I.moment_layout, I.optimizer_state(), whole, *I.gather, *I.parts, m, v);
}

void hybrid_trainer::scatter_moments(const whole_layout& whole, const tensor& m, const tensor& v) {
  auto& I = *impl_;
  // Read into copies first: the optimizer's state changes only once every part was read.
  const auto mine = I.optimizer_state();
  owned_tensor sm = zeros(mine.m.sizes()), sv = zeros(mine.v.sizes());
  auto staged = mine;
  staged.m = sm;
  staged.v = sv;
  parallel::scatter_moments(whole, m, v, I.moment_layout, staged);
  if (I.ep) {  // ZeRO 1: mine is a copy of the chunks' state
    I.ep->set_moments(sm, sv);
    return;
  }
  ops::copy(sm, mine.m);
  ops::copy(sv, mine.v);
}

std::string hybrid_trainer::moment_tiers_line() {
  if (!impl_->dp) return {};
  auto* tm = impl_->dp->moment_tiers_manager();
  if (tm == nullptr) return {};
  const auto r = tm->report();
  constexpr double mib = 1 << 20;
  return fmt::format(
      "{} in tiers: nvme {:.1f} MiB, host {:.1f} MiB (homes and slots); NVMe read "
      "{:.1f} MiB write {:.1f} MiB; {} evictions",
      impl_->cfg.plan.zero == 3 ? "ZeRO 3 shard" : "optimizer state",
      static_cast<double>(r.nvme_bytes) / mib, static_cast<double>(r.host_used) / mib,
      static_cast<double>(r.nvme_read_bytes) / mib, static_cast<double>(r.nvme_write_bytes) / mib,
      r.evictions);
}

std::string hybrid_trainer::extra_json() const {
  // f16: the loss scale and good-step count (the same on every rank), as the single process has.
  auto* s = impl_->dp ? impl_->dp->scaler() : nullptr;
  return s != nullptr ? run_state_extra(impl_->cfg, s->json()) : run_extra_json(impl_->cfg);
}

std::int64_t hybrid_trainer::optimizer_steps() const {
  return impl_->optimizer_state().steps;
}

namespace {

// The writer's `<folder>.partial` (hf::stage_folder), removed unless it was put in place.
struct staged_folder {
  std::filesystem::path dir;
  bool published = false;
  ~staged_folder() {
    std::error_code ec;
    if (!dir.empty() && !published) std::filesystem::remove_all(dir, ec);
  }
};

}  // namespace

std::string hybrid_trainer::save(const std::filesystem::path& folder) {
  auto& I = *impl_;
  const whole_layout& wl = I.whole->layout();
  auto& gather = *I.gather;
  auto& parts = *I.parts;
  const bool writer = gather.rank() == 0 && parts.rank() == 0;
  // dp rank 0's replica gathers the weights; under ep x pp every dp rank (its own experts).
  const bool gathers = gather.rank() == 0 || I.ep_pp;
  const std::string what = fmt::format("hybrid_trainer::save '{}'", folder.string());
  if (I.cfg.plan.zero != 0 && I.dp) I.dp->gather_full_parameters();
  // A rank's own work (checks, allocations, gathers, the writer's writes) runs in `attempt`, which
  // keeps the first failure; the collectives run on every rank all the same. After each phase the
  // ranks agree: when any failed, every rank throws there (the failed ones their own error, the
  // others naming the folder), so none is left waiting in a collective a failed rank skipped.
  std::exception_ptr failed;
  auto attempt = [&](auto&& f) {
    if (failed) return;
    try {
      f();
    } catch (...) {
      failed = std::current_exception();
    }
  };
  auto agree = [&] { agree_on_failure(failed, gather, parts, what); };
  // The writer streams the files into `<folder>.partial`, put in place once every byte is there
  // (hf::publish_folder); a failed save removes it (a failed publish keeps it and names it) and
  // leaves `folder` as it was.
  staged_folder staged;
  std::unique_ptr<hf::checkpoint_writer> weights;
  std::unique_ptr<hf::training_state_writer> moments;
  const hf::training_state st{
      .step = steps_done(), .optimizer_steps = optimizer_steps(), .extra_json = extra_json()};
  const auto order = hf::checkpoint_writer::order(model_);
  std::vector<const whole_param*> params;
  owned_tensor scratch;  // one whole parameter, then the failure flag
  attempt([&] {
    if (writer) {
      staged.dir = hf::stage_folder(folder);
      weights = std::make_unique<hf::checkpoint_writer>(staged.dir, model_);
      moments =
          std::make_unique<hf::training_state_writer>(staged.dir, st, dtype::f32, shape{wl.numel});
    }
    if (!gathers) return;
    std::int64_t widest = 0;
    for (const auto& e : order) {
      const whole_param* p = wl.find(e.our_name);
      TROUPE_CHECK(p != nullptr, what, ": the whole model has no parameter '", e.our_name, "'");
      params.push_back(p);
      widest = std::max(widest, p->numel());
    }
    scratch = empty({widest + 1});
  });
  agree();
  // Weights: whole parameter after parameter in the file's order, each summed over mp from the
  // parts the ranks own (every replica holds the same weights: dp rank 0's group gathers). Each
  // rank's failure flag is summed with the parameter, so the group stops together.
  if (gathers) {
    for (std::size_t i = 0; i < order.size(); ++i) {
      const std::int64_t numel = params[i]->numel();
      const tensor flat = scratch.narrow(0, 0, numel + 1);
      const tensor full = flat.narrow(0, 0, numel).reshape(params[i]->sizes);
      attempt([&] {
        ops::fill(full, 0.0);
        gather_param(I.layout, I.layout.base, order[i].our_name, full);
      });
      float* flag = static_cast<float*>(flat.data()) + numel;
      *flag = failed ? 1.0f : 0.0f;
      for (auto* group : {&parts, I.ep_pp ? &gather : nullptr})
        if (group != nullptr && group->size() > 1) {
          collective::options o;
          o.op = collective::reduce_op::sum;
          group->allreduce(flat.data(), static_cast<std::size_t>(numel + 1), flat.type(), o).wait();
        }
      if (*flag > 0.0f) break;
      if (writer) attempt([&] { weights->write(full); });
    }
  }
  agree();
  // AdamW's moments: all of m, then all of v (the file's order), in windows; a failure on any
  // rank (the writer's append included) throws on every rank (gather_moment_windows).
  const auto opt = I.optimizer_state();
  for (auto which : {which_moments::m, which_moments::v})
    gather_moment_windows(
        I.moment_layout, opt, wl, gather, parts,
        [&](std::int64_t, const tensor& wm, const tensor& wv) {
          moments->append(which == which_moments::m ? wm : wv);
        },
        which, default_window_elems, what);
  if (writer)
    attempt([&] {
      weights->commit();
      moments->commit();
      hf::write_text_file_atomically(staged.dir / "troupe_parallel.json",
                                     fmt::format("{{\"step\": {}, \"plan\": \"{}\"}}\n", st.step,
                                                 scheduler::describe(I.cfg.plan)));
      staged.published = true;  // from here on kept: a failed publish names it as the new one
      hf::publish_folder(folder);
    });
  agree();
  return writer ? folder.string() : std::string();
}

bool hybrid_trainer::gather_parameters(const tensor& to) {
  auto& I = *impl_;
  const whole_layout& wl = I.whole->layout();
  auto& gather = *I.gather;
  auto& parts = *I.parts;
  const bool writer = gather.rank() == 0 && parts.rank() == 0;
  if (I.cfg.plan.zero != 0 && I.dp) I.dp->gather_full_parameters();
  std::exception_ptr failed;
  try {
    TROUPE_CHECK(!writer || (to.defined() && to.type() == dtype::f32 && to.numel() == wl.numel),
                 "hybrid_trainer::gather_parameters: the whole model's ", wl.numel,
                 " f32 parameters do not fit the buffer given");
  } catch (...) {
    failed = std::current_exception();
  }
  agree_on_failure(failed, gather, parts, "hybrid_trainer::gather_parameters");
  // dp rank 0's replica gathers; under ep x pp every dp rank (its own experts), as save() does.
  if (gather.rank() != 0 && !I.ep_pp) return false;
  std::int64_t widest = 0;
  for (const auto& p : wl.params) widest = std::max(widest, p.numel());
  owned_tensor scratch = empty({widest});
  for (const auto& p : wl.params) {
    const tensor full = scratch.view().narrow(0, 0, p.numel()).reshape(p.sizes);
    ops::fill(full, 0.0);
    gather_param(I.layout, I.layout.base, p.name, full);
    for (auto* group : {&parts, I.ep_pp ? &gather : nullptr})
      if (group != nullptr && group->size() > 1) {
        collective::options o;
        o.op = collective::reduce_op::sum;
        group->allreduce(full.data(), static_cast<std::size_t>(p.numel()), full.type(), o).wait();
      }
    if (writer)
      ops::copy(full, to.reshape({wl.numel}).narrow(0, p.offset, p.numel()).reshape(p.sizes));
  }
  return writer;
}

hybrid_trainer::~hybrid_trainer() = default;

step_result hybrid_trainer::step(const trainer::batch_source& data) {
  if (impl_->ep) return impl_->ep->step(data);
  return impl_->dp->step(data);
}

step_result hybrid_trainer::step(const sample_source& samples) {
  TROUPE_CHECK(!impl_->ep, "hybrid_trainer: post-training steps with parallel.ep > 1 are not ",
               "supported yet");
  return impl_->dp->step(samples);
}

namespace {
constexpr const char* no_elastic_ep =
    ": elastic runs (--elastic) with parallel.ep (--ep) > 1 are not supported yet";
}  // namespace

void hybrid_trainer::prepare(const trainer::batch_source& data) {
  TROUPE_CHECK(impl_->dp, "hybrid_trainer::prepare", no_elastic_ep);
  impl_->dp->prepare(data);
}

step_result hybrid_trainer::commit() {
  TROUPE_CHECK(impl_->dp, "hybrid_trainer::commit", no_elastic_ep);
  return impl_->dp->commit();
}

void hybrid_trainer::discard_prepared() {
  if (impl_->dp) impl_->dp->discard_prepared();
}

hybrid_trainer::piece_state hybrid_trainer::state() {
  TROUPE_CHECK(impl_->dp, "hybrid_trainer::state", no_elastic_ep);
  const auto opt = impl_->dp->optimizer_state();
  // ZeRO 1-3: the shard is the state (zero 3: the piece's buffer is released between steps).
  return {.params = opt.whole ? impl_->piece->memory().params() : impl_->dp->shard_parameters(),
          .m = opt.m,
          .v = opt.v,
          .steps = impl_->dp->steps_done(),
          .optimizer_steps = opt.steps,
          .whole_optimizer = opt.whole};
}

void hybrid_trainer::set_progress(std::int64_t steps_done, std::int64_t optimizer_steps) {
  if (impl_->ep) return impl_->ep->set_progress(steps_done, optimizer_steps);
  impl_->dp->set_progress(steps_done, optimizer_steps);
}

const std::vector<dp_bucket>& hybrid_trainer::shard_buckets() const {
  TROUPE_CHECK(impl_->dp, "hybrid_trainer::shard_buckets", no_elastic_ep);
  return impl_->dp->buckets();
}

void hybrid_trainer::revive() {
  TROUPE_CHECK(impl_->dp, "hybrid_trainer::revive", no_elastic_ep);
  impl_->dp->discard_prepared();
  if (impl_->runner != nullptr) impl_->runner->revive();
}

std::int64_t hybrid_trainer::steps_done() const {
  if (impl_->ep) return impl_->ep->steps_done();
  return impl_->dp->steps_done();
}

const whole_layout& hybrid_trainer::whole() const {
  return impl_->whole->layout();
}

std::int64_t hybrid_trainer::parameters() const {
  return impl_->layout.slots->param_count();
}

std::string hybrid_trainer::describe() const {
  return impl_->description;
}

double hybrid_trainer::last_bubble_fraction() const {
  return impl_->runner != nullptr ? impl_->runner->bubble_fraction() : 0.0;
}

double hybrid_trainer::last_comm_wait_seconds() const {
  if (impl_->ep) return impl_->ep->last_load().reduce_seconds;
  return impl_->dp->last_comm_wait_seconds();
}

const ep_step_load* hybrid_trainer::last_expert_load() const {
  return impl_->ep ? &impl_->ep->last_load() : nullptr;
}

std::unique_ptr<causal_lm> make_whole_model(const hf::model_config& model, std::int64_t seq) {
  return make_causal_lm(model, {1, seq});
}

}  // namespace troupe::models::parallel
