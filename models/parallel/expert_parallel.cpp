// expert_parallel: the expert-parallel exchange and trainer (expert_parallel.hpp).
#include "models/parallel/expert_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <span>

#include <fmt/format.h>

#include "memory/error.hpp"
#include "models/families.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

void comm_exchange::counts(const std::vector<std::int64_t>& send, std::vector<std::int64_t>& recv,
                           std::int64_t per_peer) {
  TROUPE_CHECK(static_cast<std::int64_t>(send.size()) == per_peer * size(), "expert exchange (",
               ep_.name(), "): ", send.size(), " counts for ", size(), " ranks of ", per_peer);
  recv.assign(send.size(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  ep_.all_to_all(send.data(), recv.data(), static_cast<std::size_t>(per_peer), dtype::i64).wait();
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (std::size_t i = 0; i < recv.size(); ++i)
    TROUPE_CHECK(recv[i] >= 0, "expert exchange (", ep_.name(), "): rank ",
                 static_cast<std::int64_t>(i) / per_peer, " sends ", recv[i], " rows");
}

void comm_exchange::rows(const tensor& in, const std::vector<std::int64_t>& send_rows,
                         const tensor& out, const std::vector<std::int64_t>& recv_rows) {
  TROUPE_CHECK(in.is_contiguous() && out.is_contiguous() && in.type() == out.type() &&
                   in.dim() == 2 && out.dim() == 2 && in.size(1) == out.size(1),
               "expert exchange (", ep_.name(),
               "): rows must be contiguous [rows, C] of one dtype, ", "got ", in.describe(),
               " and ", out.describe());
  const auto c = static_cast<std::size_t>(in.size(1));
  std::vector<std::size_t> sc(send_rows.size()), rc(recv_rows.size());
  std::int64_t ns = 0, nr = 0;
  for (std::size_t i = 0; i < sc.size(); ++i) sc[i] = static_cast<std::size_t>(send_rows[i]) * c;
  for (std::size_t i = 0; i < rc.size(); ++i) rc[i] = static_cast<std::size_t>(recv_rows[i]) * c;
  for (auto n : send_rows) ns += n;
  for (auto n : recv_rows) nr += n;
  TROUPE_CHECK(static_cast<int>(sc.size()) == size() && static_cast<int>(rc.size()) == size() &&
                   ns <= in.size(0) && nr <= out.size(0),
               "expert exchange (", ep_.name(), "): ", ns, " rows out of ", in.describe(), ", ", nr,
               " rows into ", out.describe());
  const auto t0 = std::chrono::steady_clock::now();
  ep_.all_to_allv(in.data(), sc, out.data(), rc, in.type()).wait();
  seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string describe(const ep_step_load& l) {
  std::string s = "tokens per expert";
  for (auto n : l.tokens) s.append(" ").append(std::to_string(n));
  s += fmt::format(", imbalance {:.2f}, served here", l.imbalance);
  for (auto n : l.served) s.append(" ").append(std::to_string(n));
  s += fmt::format(" (experts {}-{})", l.first_expert,
                   l.first_expert + static_cast<std::int64_t>(l.served.size()) - 1);
  if (l.dropped > 0) s += fmt::format(", dropped {}", l.dropped);
  return s;
}

std::string ep_plan_problems(const hf::model_config& model, const train_config& cfg) {
  const auto& p = cfg.plan;
  std::vector<std::string> out;
  const auto* moe = std::get_if<hf::moe_config>(&model);
  if (moe == nullptr) {
    out.push_back(
        fmt::format("parallel.ep (--ep) {} needs an MoE model: this one has no experts", p.ep));
  } else {
    scheduler::model_shape shape{.experts = to_moe_config(*moe).n_expert};
    shape.batch = cfg.batch * cfg.grad_accum;
    for (auto& problem : scheduler::validate(p, shape)) out.push_back(problem);
    if (to_moe_config(*moe).capacity_factor > 0 || cfg.moe_capacity_factor > 0)
      out.push_back(fmt::format(
          "parallel.ep (--ep) {} is dropless only: model.moe_capacity_factor must be 0", p.ep));
  }
  if (p.tp != 1 || p.pp != 1)
    out.push_back(
        fmt::format("parallel.tp {}, parallel.pp {}: expert parallelism runs with tp = "
                    "pp = 1 (tensor and pipeline placements of experts are not written)",
                    p.tp, p.pp));
  if (p.zero > 2)
    out.push_back(fmt::format(
        "parallel.zero (--zero) {}: expert parallelism runs with ZeRO 0, 1 or 2", p.zero));
  if (p.zero >= 1 && cfg.decay_exempt)
    out.push_back(fmt::format(
        "optim.decay_exempt with parallel.zero {} under parallel.ep: the sharded update decays "
        "every parameter",
        p.zero));
  if (p.microbatches != 1)
    out.push_back(fmt::format(
        "parallel.microbatches {}: expert parallelism runs one microbatch per rank (use "
        "train.grad_accum)",
        p.microbatches));
  if (p.dp >= 1 && cfg.batch % p.dp != 0 && (cfg.batch * cfg.grad_accum) % p.dp == 0)
    out.push_back(
        fmt::format("parallel.dp {} does not divide train.batch {} (each rank takes its "
                    "rows of every draw)",
                    p.dp, cfg.batch));
  if (cfg.precision != "f32")
    out.push_back("train.precision " + cfg.precision + ": expert parallelism trains in f32");
  std::string s;
  for (const auto& o : out) {
    if (!s.empty()) s.append("; ");
    s.append(o);
  }
  return s;
}

namespace {

// [begin, length) of the flat buffers, with the group its gradients are reduced over.
struct grad_range {
  std::int64_t begin = 0, length = 0;
  bool expert = false;
};

// The parameters' ranges in layer_memory order, consecutive ones of the same kind merged, with the
// alignment padding between them (its gradients stay zero; reducing and updating them changes
// nothing). Fails when parameters overlap or lie outside the buffer.
std::vector<grad_range> ranges_of(const slot_list& slots, const tensor& params) {
  std::vector<grad_range> r;
  for (const auto& s : slots.slots()) {
    if (s.kind != slot_kind::param) continue;
    const auto off =
        (static_cast<const char*>(s.field->data()) - static_cast<const char*>(params.data())) /
        static_cast<std::ptrdiff_t>(params.element_size());
    r.push_back({off, s.field->numel(), s.spec.expert >= 0});
  }
  std::sort(r.begin(), r.end(), [](auto& a, auto& b) { return a.begin < b.begin; });
  std::vector<grad_range> merged;
  std::int64_t end = 0;
  for (const auto& x : r) {
    TROUPE_CHECK(x.begin >= end && x.begin + x.length <= params.numel(),
                 "ep_trainer: a parameter at [", x.begin, ", ", x.begin + x.length,
                 ") overlaps another or lies outside the flat buffer of ", params.numel());
    if (!merged.empty() && merged.back().expert == x.expert)
      merged.back().length = x.begin + x.length - merged.back().begin;
    else
      merged.push_back(x);
    end = x.begin + x.length;
  }
  return merged;
}

double sum_squares(const tensor& t) {
  const float* p = t.data_as<float>();
  double s = 0;
  for (std::int64_t i = 0; i < t.numel(); ++i) s += static_cast<double>(p[i]) * p[i];
  return s;
}

}  // namespace

struct ep_trainer::impl {
  train_config cfg;
  ep_groups g;
  std::unique_ptr<causal_lm_of<moe>> model;
  std::unique_ptr<comm_exchange> exchange;
  std::vector<grad_range> ranges;
  // zero 0: one optimizer over the flat buffer; zero 1: one per range over this rank's chunk.
  std::unique_ptr<adamw_optimizer> full;
  struct chunk {
    std::int64_t begin = 0, length = 0;  // this rank's part of the range (flat coordinates)
    std::int64_t chunk = 0;              // ceil(range / group size)
    std::unique_ptr<adamw_optimizer> opt;
  };
  std::vector<chunk> chunks;
  owned_tensor gather_in, gather_out;  // zero 1: staging of the padded all_gather
  owned_tensor state_m, state_v;       // zero 1: optimizer_state's copy of the chunks' moments
  std::vector<std::int32_t> draw_rows, rows, targets;

  collective::communicator& group_of(const grad_range& r) const {
    return r.expert ? *g.edp : *g.dp;
  }
};

ep_trainer::ep_trainer(const hf::model_config& model, const train_config& cfg, const ep_groups& g)
    : impl_(std::make_unique<impl>()) {
  auto& I = *impl_;
  I.cfg = cfg;
  I.g = g;
  cfg.validate();
  const auto& p = cfg.plan;
  TROUPE_CHECK(g.dp != nullptr && g.ep != nullptr && g.edp != nullptr,
               "ep_trainer: the dp, ep and edp groups must all be given");
  TROUPE_CHECK(g.dp->size() == p.dp && g.ep->size() == p.ep && p.ep >= 1 &&
                   g.edp->size() * p.ep == p.dp && g.ep->rank() == g.dp->rank() % p.ep,
               "ep_trainer: parallel.dp ", p.dp, " and parallel.ep ", p.ep, " need a dp group of ",
               p.dp, " ranks (got ", g.dp->size(), "), an ep group of ", p.ep, " (got ",
               g.ep->size(), ", this rank ", g.ep->rank(), " for dp rank ", g.dp->rank(),
               ") and an expert-data-parallel group of dp / ep (got ", g.edp->size(), ")");
  if (auto problems = ep_plan_problems(model, cfg); !problems.empty()) throw error(problems);
  moe_config c = to_moe_config(std::get<hf::moe_config>(model));
  c.ep = p.ep;
  c.ep_rank = g.ep->rank();
  c.recompute = cfg.recompute;
  I.model = std::make_unique<causal_lm_of<moe>>(c, batch_dims{cfg.batch / p.dp, cfg.seq});
  I.exchange = std::make_unique<comm_exchange>(*g.ep);
  I.model->model().set_expert_exchange(I.exchange.get());
  const tensor& params = I.model->memory().params();
  I.ranges = ranges_of(I.model->slots(), params);
  const ops::adamw_options o{
      .beta1 = cfg.beta1, .beta2 = cfg.beta2, .eps = cfg.eps, .weight_decay = cfg.weight_decay};
  if (p.zero == 0) {
    I.full = std::make_unique<adamw_optimizer>(params, o);
    if (cfg.decay_exempt)
      I.full->exempt_from_decay(I.model->slots(), params, biases_norms_embeddings);
    return;
  }
  std::int64_t most = 0;
  for (const auto& r : I.ranges) {
    auto& grp = I.group_of(r);
    const std::int64_t n = grp.size(), ch = (r.length + n - 1) / n;
    const std::int64_t b = std::min(r.length, ch * grp.rank());
    const std::int64_t len = std::min(r.length, b + ch) - b;
    impl::chunk k{r.begin + b, len, ch, nullptr};
    if (len > 0) k.opt = std::make_unique<adamw_optimizer>(params.narrow(0, k.begin, len), o);
    I.chunks.push_back(std::move(k));
    most = std::max(most, ch * n);
  }
  I.gather_in = empty({most}, dtype::f32);
  I.gather_out = empty({most}, dtype::f32);
}

ep_trainer::~ep_trainer() = default;

causal_lm& ep_trainer::model() {
  return *impl_->model;
}

std::int64_t ep_trainer::optimizer_elements() const {
  if (impl_->full) return impl_->full->m().numel();
  std::int64_t n = 0;
  for (const auto& c : impl_->chunks) n += c.length;
  return n;
}

dp_trainer::optimizer_view ep_trainer::optimizer_state() {
  auto& I = *impl_;
  dp_trainer::optimizer_view out;
  if (I.full) {
    out.m = I.full->m();
    out.v = I.full->v();
    out.runs.push_back({0, 0, I.full->m().numel()});
    out.steps = I.full->steps_taken();
    out.whole = true;
    return out;
  }
  const std::int64_t n = std::max<std::int64_t>(optimizer_elements(), 1);
  if (!I.state_m.view().defined() || I.state_m.view().numel() != n) {
    I.state_m = zeros({n});
    I.state_v = zeros({n});
  }
  out.m = I.state_m.view();
  out.v = I.state_v.view();
  std::int64_t at = 0;
  for (const auto& k : I.chunks) {
    if (!k.opt) continue;
    ops::copy(k.opt->m(), out.m.narrow(0, at, k.length));
    ops::copy(k.opt->v(), out.v.narrow(0, at, k.length));
    out.runs.push_back({k.begin, at, k.length});
    out.steps = k.opt->steps_taken();
    at += k.length;
  }
  return out;
}

void ep_trainer::set_moments(const tensor& m, const tensor& v) {
  auto& I = *impl_;
  TROUPE_CHECK(m.numel() >= optimizer_elements() && v.numel() >= optimizer_elements(),
               "ep_trainer: moments of ", m.numel(), " and ", v.numel(),
               " elements for a state of ", optimizer_elements());
  if (I.full) {
    if (m.data() != I.full->m().data()) ops::copy(m.narrow(0, 0, I.full->m().numel()), I.full->m());
    if (v.data() != I.full->v().data()) ops::copy(v.narrow(0, 0, I.full->v().numel()), I.full->v());
    return;
  }
  std::int64_t at = 0;
  for (const auto& k : I.chunks) {
    if (!k.opt) continue;
    ops::copy(m.narrow(0, at, k.length), k.opt->m());
    ops::copy(v.narrow(0, at, k.length), k.opt->v());
    at += k.length;
  }
}

void ep_trainer::set_progress(std::int64_t steps_done, std::int64_t optimizer_steps) {
  auto& I = *impl_;
  TROUPE_CHECK(steps_done >= 0 && optimizer_steps >= 0 && optimizer_steps <= steps_done,
               "ep_trainer: cannot resume at step ", steps_done, " with ", optimizer_steps,
               " optimizer steps");
  step_ = steps_done;
  if (I.full) I.full->set_steps_taken(optimizer_steps);
  for (auto& k : I.chunks)
    if (k.opt) k.opt->set_steps_taken(optimizer_steps);
}

step_result ep_trainer::step(const trainer::batch_source& data) {
  auto& I = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  const auto& c = I.cfg;
  const int dp = c.plan.dp, d = I.g.dp->rank();
  const int batch = static_cast<int>(c.batch), seq = static_cast<int>(c.seq), per = batch / dp;
  auto& m = I.model->model();
  auto& mem = I.model->memory();
  const tensor& params = mem.params();
  const tensor& grads = mem.grads();
  mem.zero_grads();

  // Forward and backward of this rank's rows of every draw.
  std::vector<double> tokens;  // per expert, this rank's choices (then the job's)
  ep_step_load load;
  const double exchanged = I.exchange->seconds();
  double loss = 0;
  const double scale = 1.0 / (static_cast<double>(dp) * static_cast<double>(c.grad_accum));
  for (std::int64_t k = 0; k < c.grad_accum; ++k) {
    const auto draw = c.fixed_batch ? 0 : static_cast<std::uint64_t>(step_ * c.grad_accum + k);
    data(draw, batch, seq, I.draw_rows);
    I.rows.assign(I.draw_rows.begin() + static_cast<std::ptrdiff_t>(d) * per * seq,
                  I.draw_rows.begin() + static_cast<std::ptrdiff_t>(d + 1) * per * seq);
    I.targets.resize(I.rows.size());
    tensor ids(I.rows.data(), I.rows.size() * 4, dtype::i32, {per, seq});
    tensor tg(I.targets.data(), I.targets.size() * 4, dtype::i32, {per, seq});
    next_token_targets(ids, tg);
    loss += I.model->forward(ids, tg);
    I.model->backward(scale);
    const moe_load l = m.load();
    tokens.resize(l.selected.size(), 0.0);
    for (std::size_t e = 0; e < tokens.size(); ++e) tokens[e] += static_cast<double>(l.selected[e]);
    load.first_expert = l.first_expert;
    load.served.resize(l.served.size(), 0);
    for (std::size_t j = 0; j < l.served.size(); ++j) load.served[j] += l.served[j];
    load.dropped += l.dropped;
  }

  load.exchange_seconds = I.exchange->seconds() - exchanged;
  const auto issued = std::chrono::steady_clock::now();
  load.compute_seconds = std::chrono::duration<double>(issued - t0).count();

  // The gradients: non-expert over dp, expert over the expert-data-parallel group (ZeRO 2:
  // reduce-scattered below); the loss and the load over dp. Every rank issues the same ops in the
  // same order (the layouts agree).
  const bool zero2 = c.plan.zero == 2;
  std::vector<collective::work> pending;
  for (const auto& r : I.ranges) {
    auto& grp = I.group_of(r);
    if (grp.size() > 1 && !zero2)
      pending.push_back(grp.allreduce(grads.narrow(0, r.begin, r.length).data(),
                                      static_cast<std::size_t>(r.length), dtype::f32));
  }
  std::vector<double> stats = tokens;
  stats.push_back(loss);
  stats.push_back(static_cast<double>(load.dropped));
  if (dp > 1) pending.push_back(I.g.dp->allreduce(stats.data(), stats.size(), dtype::f64));
  for (auto& w : pending) w.wait();
  const auto reduced = std::chrono::steady_clock::now();
  load.reduce_seconds = std::chrono::duration<double>(reduced - issued).count();
  loss = stats[tokens.size()] / (static_cast<double>(dp) * static_cast<double>(c.grad_accum));
  load.dropped = static_cast<std::int64_t>(stats[tokens.size() + 1]);
  load.tokens.assign(tokens.size(), 0);
  double most = 0, sum = 0;
  for (std::size_t e = 0; e < tokens.size(); ++e) {
    load.tokens[e] = static_cast<std::int64_t>(stats[e]);
    most = std::max(most, stats[e]);
    sum += stats[e];
  }
  load.imbalance = sum > 0 ? most * static_cast<double>(tokens.size()) / sum : 0.0;

  step_result res;
  if (zero2) {
    // ZeRO 2: each range reduce-scattered over its group (padded to chunk x group size in the
    // staging buffer), this rank's chunk of the sum written back into its place in grads; the
    // rest of grads is this rank's own and is not read again. The norm: the chunks of every dp
    // rank hold each element once (the non-expert ranges over dp; an expert's range over the edp
    // ranks of the one ep rank holding it), so their squares summed over dp.
    double sq = 0;
    for (std::size_t i = 0; i < I.ranges.size(); ++i) {
      const auto& r = I.ranges[i];
      const auto& k = I.chunks[i];
      auto& grp = I.group_of(r);
      if (grp.size() > 1) {
        const std::int64_t all = k.chunk * grp.size();
        const tensor in = I.gather_out.narrow(0, 0, all);
        const tensor out = I.gather_in.narrow(0, 0, k.chunk);
        ops::copy(grads.narrow(0, r.begin, r.length), in.narrow(0, 0, r.length));
        if (all > r.length) ops::fill(in.narrow(0, r.length, all - r.length), 0.0);
        grp.reduce_scatter(in.data(), out.data(), static_cast<std::size_t>(k.chunk), dtype::f32)
            .wait();
        if (k.length > 0) ops::copy(out.narrow(0, 0, k.length), grads.narrow(0, k.begin, k.length));
      }
      if (k.length > 0) sq += sum_squares(grads.narrow(0, k.begin, k.length));
    }
    load.reduce_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - reduced)
                               .count();  // the reduce-scatters
    if (dp > 1) I.g.dp->allreduce(&sq, 1, dtype::f64).wait();
    res.grad_norm = std::sqrt(sq);
    const double f = clip_factor(res.grad_norm, c.clip);
    if (f != 1.0)
      for (const auto& k : I.chunks)
        if (k.length > 0) ops::scale(grads.narrow(0, k.begin, k.length), f);
  } else {
    // The global norm: the non-expert part (the same on every rank) and the expert parts of the
    // ep group's ranks (disjoint experts; every expert-parallel group holds the same values).
    double sq[2] = {0, 0};
    for (const auto& r : I.ranges)
      sq[r.expert ? 1 : 0] += sum_squares(grads.narrow(0, r.begin, r.length));
    if (I.g.ep->size() > 1) I.g.ep->allreduce(&sq[1], 1, dtype::f64).wait();
    res.grad_norm = std::sqrt(sq[0] + sq[1]);
    const double f = clip_factor(res.grad_norm, c.clip);
    if (f != 1.0) ops::scale(grads, f);
  }
  res.lr = warmup_cosine_lr(step_, c.warmup, c.steps, c.lr, c.min_lr);
  if (I.full) {
    I.full->step(params, grads, res.lr);
  } else {
    // ZeRO 1 and 2: each rank updates its chunk of every range, then the chunks are all-gathered.
    for (std::size_t i = 0; i < I.ranges.size(); ++i) {
      const auto& r = I.ranges[i];
      auto& k = I.chunks[i];
      if (k.opt)
        k.opt->step(params.narrow(0, k.begin, k.length), grads.narrow(0, k.begin, k.length),
                    res.lr);
      auto& grp = I.group_of(r);
      if (grp.size() == 1) continue;
      const tensor in = I.gather_in.narrow(0, 0, k.chunk);
      const tensor out = I.gather_out.narrow(0, 0, k.chunk * grp.size());
      if (k.length > 0) ops::copy(params.narrow(0, k.begin, k.length), in.narrow(0, 0, k.length));
      grp.all_gather(in.data(), out.data(), static_cast<std::size_t>(k.chunk), dtype::f32).wait();
      ops::copy(out.narrow(0, 0, r.length), params.narrow(0, r.begin, r.length));
    }
  }
  ++step_;
  load_ = std::move(load);
  res.step = step_;
  res.loss = loss;
  res.tokens = c.batch * c.seq * c.grad_accum;
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace troupe::models::parallel
