// offload_trainer (see offload_trainer.hpp): chunked parameters, gradients and AdamW state under
// a tier manager, driving a streamed_model unit by unit.
#include "models/offload/offload_trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <future>
#include <utility>
#include <vector>

#include "memory/error.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/training_state.hpp"
#include "models/optim.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

using memory::tier;

// The chunks a step holds pinned; those still held when the step throws are released (clean),
// so a failed step leaves no chunk pinned for good.
class pin_guard {
 public:
  explicit pin_guard(memory::tier_manager& t) : tiers_(t) { held_.reserve(16); }
  pin_guard(const pin_guard&) = delete;
  pin_guard& operator=(const pin_guard&) = delete;
  ~pin_guard() {
    for (const auto& [c, w] : held_) {
      try {
        tiers_.release(c, w, false);
      } catch (...) {  // on the way out of a failure already
      }
    }
  }
  std::byte* acquire(std::int32_t c, tier w, bool discard = false) {
    held_.reserve(held_.size() + 1);  // no allocation failure once the chunk is pinned
    std::byte* p = tiers_.acquire(c, w, discard);
    held_.emplace_back(c, w);
    return p;
  }
  void release(std::int32_t c, tier w, bool dirty) {
    auto it = std::find(held_.begin(), held_.end(), std::pair{c, w});
    if (it != held_.end()) held_.erase(it);  // release unpins even when it throws
    tiers_.release(c, w, dirty);
  }

 private:
  memory::tier_manager& tiers_;
  std::vector<std::pair<std::int32_t, tier>> held_;
};

memory::tier_manager_options manager_options(const offload_options& o) {
  memory::tier_manager_options m;
  m.device_bytes = o.device_bytes;
  m.host_bytes = o.host_bytes;
  m.nvme_dir = o.nvme_dir;
  m.nvme_capacity_bytes = o.nvme_capacity_bytes;
  m.nvme_io = o.nvme_io;
  m.prefetch_depth = o.prefetch_depth;
  return m;
}

// The model's dtype for train.precision: f32, or bf16 with f32 master weights.
dtype compute_of(const train_config& cfg) {
  TROUPE_CHECK(cfg.precision == "f32" || cfg.precision == "bf16", "offload_trainer: precision ",
               cfg.precision,
               " is not supported (f32 or bf16; f16 needs loss scaling with skipped steps)");
  return cfg.precision == "bf16" ? dtype::bf16 : dtype::f32;
}

memory::chunk_size_choice choose(const streamed_model& model, std::vector<std::int32_t>& slots,
                                 const offload_options& o) {
  std::vector<std::size_t> sizes;
  const auto& all = model.slots().slots();
  for (std::size_t i = 0; i < all.size(); ++i) {
    if (all[i].kind != slot_kind::param) continue;
    slots.push_back(static_cast<std::int32_t>(i));
    sizes.push_back(static_cast<std::size_t>(all[i].sizes.numel()) * 4);
  }
  auto cands = o.chunk_candidates.empty() ? memory::default_chunk_candidates() : o.chunk_candidates;
  return memory::choose_chunk_size(sizes, cands, 64);
}

}  // namespace

offload_trainer::offload_trainer(const gpt_config& model, const train_config& cfg,
                                 const offload_options& opt)
    : offload_trainer(make_streamed_model(model, {cfg.batch, cfg.seq}, compute_of(cfg)), cfg, opt) {
}

offload_trainer::offload_trainer(const llama_config& model, const train_config& cfg,
                                 const offload_options& opt)
    : offload_trainer(make_streamed_model(model, {cfg.batch, cfg.seq}, compute_of(cfg)), cfg, opt) {
}

offload_trainer::offload_trainer(const hf::model_config& model, const train_config& cfg,
                                 const offload_options& opt)
    : offload_trainer(
          make_streamed_model(model, {cfg.batch, cfg.seq}, cfg.recompute, compute_of(cfg)), cfg,
          opt) {}

offload_trainer::offload_trainer(std::unique_ptr<streamed_model> model, const train_config& cfg,
                                 const offload_options& opt)
    : cfg_(cfg),
      compute_(compute_of(cfg)),
      opt_(opt),
      model_(std::move(model)),
      chunks_(choose(*model_, param_slots_, opt)),
      tiers_(manager_options(opt)) {
  cfg_.validate();
  for (tier t : {opt.placement.param_tier, opt.placement.optim_tier})
    TROUPE_CHECK(t == tier::host || t == tier::nvme,
                 "offload_trainer: param_tier and optim_tier must be host or nvme, got ",
                 memory::tier_name(t));
  const auto& all = model_->slots().slots();
  const auto nt = static_cast<std::int32_t>(param_slots_.size());
  std::vector<std::int32_t> tensor_of(all.size(), -1);
  for (std::int32_t j = 0; j < nt; ++j) tensor_of[param_slots_[j]] = j;
  last_backward_unit_.assign(nt, model_->units());
  for (std::int32_t u = 0; u < model_->units(); ++u) {
    std::vector<std::int32_t> cs, ts;
    for (std::int32_t s : model_->unit_params(u)) {
      const std::int32_t j = tensor_of[s];
      ts.push_back(j);
      last_backward_unit_[j] = std::min(last_backward_unit_[j], u);
      const std::int32_t c = chunks_.layout.records[j].chunk;
      if (std::find(cs.begin(), cs.end(), c) == cs.end()) cs.push_back(c);
    }
    unit_chunks_.push_back(std::move(cs));
    unit_tensors_.push_back(std::move(ts));
  }
  for (std::int32_t j = 0; j < nt; ++j) {
    const auto& s = all[param_slots_[j]];
    decays_.push_back(!(cfg.decay_exempt && biases_norms_embeddings(s)));
  }
  if (mixed()) {
    // One unit's parameters (and gradients) at a time, each tensor 64-byte aligned as the whole
    // model places them.
    const auto elem = static_cast<std::int64_t>(dtype_size(compute_));
    std::int64_t widest = 0;
    for (const auto& ts : unit_tensors_) {
      std::vector<std::int64_t> at;
      std::int64_t used = 0;
      for (std::int32_t j : ts) {
        used = (used + 63) / 64 * 64;
        at.push_back(used / elem);
        used += all[param_slots_[j]].sizes.numel() * elem;
      }
      widest = std::max(widest, (used + 63) / 64 * 64);
      work_at_.push_back(std::move(at));
    }
    work_params_ = zeros({widest / elem}, compute_, device::cpu());
    work_grads_ = zeros({widest / elem}, compute_, device::cpu());
    work_bytes_ = 2 * static_cast<std::size_t>(widest);
  }
  place(tiers_, non_model_bytes());
}

tier offload_trainer::access_tier(std::int32_t id) const {
  return tiers_.home(id) == tier::device ? tier::device : tier::host;
}

void offload_trainer::place(memory::tier_manager& into, std::size_t non_model) {
  into.reserve(tier::device, non_model);
  const std::int32_t n = chunk_count();
  const std::size_t cb = chunks_.layout.chunk_bytes;
  const auto& pl = opt_.placement;
  std::vector<bool> p_dev(n, true), o_dev(n, true);
  if (pl.how == offload_placement::mode::fixed) {
    TROUPE_CHECK(pl.param_fraction >= 0 && pl.param_fraction <= 1 && pl.optim_fraction >= 0 &&
                     pl.optim_fraction <= 1,
                 "offload_trainer: param_fraction and optim_fraction must be in [0, 1]");
    const auto np = static_cast<std::int32_t>(std::lround(pl.param_fraction * n));
    const auto no = static_cast<std::int32_t>(std::lround(pl.optim_fraction * n));
    for (std::int32_t i = 0; i < n; ++i) {
      p_dev[i] = i >= np;
      o_dev[i] = i >= no;
    }
  } else {
    // Room for the slots one unit's backward pins at once (parameters and gradients), plus two
    // for prefetch; the rest of the budget after the non-model memory keeps chunks resident.
    std::size_t working = 0;
    for (const auto& cs : unit_chunks_) working = std::max(working, 2 * cs.size());
    const std::size_t need = non_model + (working + 2) * cb;
    std::size_t room = opt_.device_bytes > need ? opt_.device_bytes - need : 0;
    for (std::int32_t i = 0; i < n; ++i) {
      p_dev[i] = room >= 2 * cb;  // parameters and gradients
      if (p_dev[i]) room -= 2 * cb;
      o_dev[i] = false;
    }
    for (std::int32_t i = 0; i < n; ++i) {
      o_dev[i] = p_dev[i] && room >= 2 * cb;  // m and v (the update then runs on the device)
      if (o_dev[i]) room -= 2 * cb;
    }
  }
  optim_at_.resize(n);
  for (std::int32_t i = 0; i < n; ++i)
    optim_at_[i] = p_dev[i] && o_dev[i] ? tier::device : tier::host;
  for (std::int32_t i = 0; i < n; ++i)
    into.add_chunk(cb, p_dev[i] ? tier::device : pl.param_tier, "param." + std::to_string(i));
  for (std::int32_t i = 0; i < n; ++i) {
    // Gradients live where their update runs, with the optimizer state.
    const tier g = optim_at_[i] == tier::device ? tier::device : pl.optim_tier;
    into.add_chunk(cb, g, "grad." + std::to_string(i));
  }
  for (const char* kind : {"m.", "v."})
    for (std::int32_t i = 0; i < n; ++i)
      into.add_chunk(cb, o_dev[i] ? tier::device : pl.optim_tier, kind + std::to_string(i));
  build_schedule();
  into.set_schedule(schedule_);
}

void offload_trainer::place_measured(std::size_t measured) {
  const std::int32_t n = chunk_count();
  const std::vector<tier> before_optim = optim_at_;
  std::vector<tier> before_homes;
  for (std::int32_t id = 0; id < 4 * n; ++id) before_homes.push_back(tiers_.home(id));
  memory::tier_manager fresh(manager_options(opt_));
  place(fresh, measured);
  bool same = true;
  for (std::int32_t id = 0; id < 4 * n; ++id) same = same && fresh.home(id) == before_homes[id];
  if (same) {  // nothing moves: keep the warm manager (its caches and statistics)
    optim_at_ = before_optim;
    build_schedule();
    return;
  }
  // Parameters, m and v move; gradients are zeroed at their first touch in the next step.
  const std::size_t cb = chunks_.layout.chunk_bytes;
  for (std::int32_t id = 0; id < 4 * n; ++id) {
    if (id >= n && id < 2 * n) continue;
    const tier from = access_tier(id);
    const tier to = fresh.home(id) == tier::device ? tier::device : tier::host;
    std::byte* src = tiers_.acquire(id, from);
    std::byte* dst = fresh.acquire(id, to, true);
    std::memcpy(dst, src, cb);
    fresh.release(id, to, true);
    tiers_.release(id, from, false);
  }
  fresh.rewind();
  tiers_ = std::move(fresh);
  replaced_ = true;
  laid_out_ = false;  // the next step lays out and checks the new pools
}

void offload_trainer::build_schedule() {
  const std::int32_t n = chunk_count();
  schedule_.clear();
  for (std::int64_t k = 0; k < cfg_.grad_accum; ++k) {
    for (std::int32_t u = 0; u < model_->units(); ++u)
      for (std::int32_t c : unit_chunks_[u]) schedule_.push_back({c, tier::device});
    for (std::int32_t u = model_->units() - 1; u >= 0; --u)
      for (std::int32_t c : unit_chunks_[u]) {
        schedule_.push_back({c, tier::device});
        schedule_.push_back({n + c, tier::device});
      }
  }
  for (std::int32_t i = 0; i < n; ++i)
    for (std::int32_t k = 0; k < 4; ++k) schedule_.push_back({k * n + i, optim_at_[i]});
}

std::size_t offload_trainer::model_state_bytes() const {
  return 4 * chunks_.layout.total_bytes();
}

std::size_t offload_trainer::pinned_at_once(tier where) const {
  const std::int32_t n = chunk_count();
  auto away = [&](std::int32_t id) { return tiers_.home(id) != where ? 1u : 0u; };
  std::size_t most = 0;
  if (where == tier::device)
    for (const auto& cs : unit_chunks_) {
      std::size_t k = 0;
      for (std::int32_t c : cs) k += away(c) + away(n + c);
      most = std::max(most, k);
    }
  for (std::int32_t i = 0; i < n; ++i) {
    if (optim_at_[i] != where) continue;
    std::size_t k = 0;
    for (std::int32_t j = 0; j < 4; ++j) k += away(j * n + i);
    most = std::max(most, k);
  }
  return most;
}

void offload_trainer::check_budgets() {
  // The pools are laid out on the first acquire; a parameter chunk in its home tier costs nothing.
  const tier t = access_tier(0);
  tiers_.acquire(0, t);
  tiers_.release(0, t, false);
  tiers_.rewind();
  for (tier w : {tier::device, tier::host}) {
    const std::size_t need = pinned_at_once(w);
    TROUPE_CHECK(tiers_.slots(w) >= need, "offload_trainer: the ", memory::tier_name(w),
                 " budget holds ", tiers_.slots(w), " chunk slots but a step pins ", need,
                 " at once (chunk size ", chunks_.layout.chunk_bytes, " bytes)");
  }
  // The overlapped optimizer pins two chunks' groups at once.
  // (Only host groups pin slots there: a group updated on the device has all its homes there.)
  overlap_ = opt_.overlap_optimizer && tiers_.slots(tier::host) >= 2 * pinned_at_once(tier::host);
  laid_out_ = true;
}

tensor offload_trainer::work_view(const tensor& buf, std::int32_t u, std::size_t k) const {
  const std::int32_t j = unit_tensors_[u][k];
  const auto& s = model_->slots().slots()[param_slots_[j]];
  return buf.narrow(0, work_at_[u][k], s.sizes.numel()).reshape(s.sizes);
}

void offload_trainer::bind_mixed(std::int32_t u, std::int32_t c, std::byte* p, std::byte* g) {
  const auto& all = model_->slots().slots();
  const auto& ts = unit_tensors_[u];
  for (std::size_t k = 0; k < ts.size(); ++k) {
    const std::int32_t j = ts[k];
    if (chunks_.layout.records[j].chunk != c) continue;
    const auto& s = all[param_slots_[j]];
    *s.field = work_view(work_params_, u, k);
    ops::copy(view(p, j), *s.field);  // the master weights rounded, as trainer rounds them
    if (g == nullptr) continue;
    *s.grad = work_view(work_grads_, u, k);
    ops::copy(view(g, j), *s.grad);  // bf16 values so far: exact
  }
}

void offload_trainer::round_master() {
  const std::int32_t n = chunk_count();
  for (std::int32_t c = 0; c < n; ++c) {
    const tier t = access_tier(c);
    std::byte* base = tiers_.acquire(c, t);
    for (std::int32_t j : chunks_.layout.members[c]) {
      const tensor v = view(base, j);
      owned_tensor r = empty(v.sizes(), compute_, device::cpu());
      ops::copy(v, r);
      ops::copy(r, v);
    }
    tiers_.release(c, t, true);
  }
  tiers_.rewind();  // off the schedule
}

tensor offload_trainer::view(std::byte* base, std::int32_t j) const {
  const auto& rec = chunks_.layout.records[j];
  const auto& s = model_->slots().slots()[param_slots_[j]];
  return tensor(base + rec.offset, rec.bytes, dtype::f32, s.sizes, device::cpu());
}

void offload_trainer::copy_kind(const slot_list& s, int kind, bool out) {
  const std::int32_t n = chunk_count();
  const auto& all = model_->slots().slots();
  std::vector<const tensor_slot*> by_tensor(param_slots_.size(), nullptr);
  for (std::int32_t j = 0; j < static_cast<std::int32_t>(param_slots_.size()); ++j) {
    const auto& mine = all[param_slots_[j]];
    for (const auto& o : s.slots())
      if (o.kind == slot_kind::param && o.name == mine.name) by_tensor[j] = &o;
    TROUPE_CHECK(out || by_tensor[j] != nullptr, "offload_trainer: the source has no parameter '",
                 mine.name, "'");
  }
  for (std::int32_t c = 0; c < n; ++c) {
    const std::int32_t id = kind * n + c;
    const tier t = access_tier(id);
    std::byte* base = tiers_.acquire(id, t);
    for (std::int32_t j : chunks_.layout.members[c]) {
      const tensor_slot* o = by_tensor[j];
      if (o == nullptr) continue;
      const tensor& theirs = kind == 0 ? *o->field : *o->grad;
      if (out)
        ops::copy(view(base, j), theirs);
      else
        ops::copy(theirs, view(base, j));
    }
    tiers_.release(id, t, !out);
  }
  tiers_.rewind();  // the acquires above were off the schedule
}

void offload_trainer::set_weights(const slot_list& src) {
  TROUPE_CHECK(step_ == 0, "offload_trainer: set_weights before the first step");
  copy_kind(src, 0, false);
  if (mixed()) round_master();
}

void offload_trainer::copy_weights_to(const slot_list& dst) {
  copy_kind(dst, 0, true);
}

void offload_trainer::copy_moments(const param_placement& flat_layout, int kind, const tensor& flat,
                                   bool out) {
  const std::int32_t n = chunk_count();
  const auto& all = model_->slots().slots();
  for (std::int32_t c = 0; c < n; ++c) {
    const std::int32_t id = kind * n + c;
    const tier t = access_tier(id);
    std::byte* base = tiers_.acquire(id, t);
    for (std::int32_t j : chunks_.layout.members[c]) {
      const auto& s = all[param_slots_[j]];
      const tensor theirs =
          flat.narrow(0, flat_layout.offsets[j], s.sizes.numel()).reshape(s.sizes);
      if (out)
        ops::copy(view(base, j), theirs);
      else
        ops::copy(theirs, view(base, j));
    }
    tiers_.release(id, t, !out);
  }
  tiers_.rewind();  // the acquires above were off the schedule
}

void offload_trainer::check_staging(causal_lm& staging) const {
  TROUPE_CHECK(staging.memory().params().type() == dtype::f32,
               "offload_trainer: the staging model carries the f32 (master) weights: it must be "
               "built in f32, got ",
               dtype_name(staging.memory().params().type()));
}

expected<std::filesystem::path> offload_trainer::save(const std::filesystem::path& folder,
                                                      const hf::model_config& cfg,
                                                      causal_lm& staging) {
  using result = expected<std::filesystem::path>;
  check_staging(staging);
  return hf::save_folder_atomically(folder, [&](const std::filesystem::path& dir) -> result {
    copy_kind(staging.slots(), 0, true);
    auto files = hf::save_checkpoint(dir, cfg, staging.slots());
    if (!files) return result::failure(files.error_message());
    // The moments flat, laid out as trainer's model in the run's precision lays its parameters.
    const param_placement lay = place_params(model_->slots(), compute_);
    owned_tensor m = zeros({lay.numel}, dtype::f32, device::cpu());
    owned_tensor v = zeros({lay.numel}, dtype::f32, device::cpu());
    copy_moments(lay, 2, m, true);
    copy_moments(lay, 3, v, true);
    hf::training_state st{.step = step_,
                          .optimizer_steps = step_,
                          .extra_json = run_state_extra(cfg_, R"({"offload": true})")};
    auto ts = hf::save_training_state(dir, st, m, v);
    if (!ts) return result::failure(ts.error_message());
    return dir;
  });
}

expected<std::int64_t> offload_trainer::resume(const std::filesystem::path& folder,
                                               const hf::model_config& cfg, causal_lm& staging) {
  using result = expected<std::int64_t>;
  TROUPE_CHECK(step_ == 0, "offload_trainer: resume before the first step");
  check_staging(staging);
  const param_placement lay = place_params(model_->slots(), compute_);
  auto saved = resumable_state(folder, cfg_, shape{lay.numel});  // before anything is loaded
  if (!saved) return result::failure(saved.error_message());
  auto w = hf::load_weights(folder, cfg, staging.slots());
  if (!w) return result::failure(w.error_message());
  copy_kind(staging.slots(), 0, false);  // the master weights as saved (no rounding)
  owned_tensor m = empty({lay.numel}, dtype::f32, device::cpu());
  owned_tensor v = empty({lay.numel}, dtype::f32, device::cpu());
  auto st = hf::load_training_state(folder, m, v);
  if (!st) return result::failure(st.error_message());
  copy_moments(lay, 2, m, false);
  copy_moments(lay, 3, v, false);
  TROUPE_CHECK(st->optimizer_steps == st->step, "offload_trainer: ", folder.string(),
               ": optimizer_steps ", st->optimizer_steps, " differ from step ", st->step,
               " (a skipped f16 step): resume it with the plain trainer");
  step_ = st->step;
  return step_;
}

step_result offload_trainer::step(const trainer::batch_source& data) {
  // automatic: the first step measures the non-model memory. The pools are laid out first, so
  // what the step allocates beyond the host's bytes in use now is activations and scratch.
  const bool measure = opt_.placement.how == offload_placement::mode::automatic && measured_ == 0;
  if (!laid_out_) check_budgets();
  std::int64_t in_use = 0;
  if (measure) {
    in_use = memory::stats(tier::host).in_use;
    memory::reset_peak(tier::host);
  }
  step_result r = run_step(data);
  if (measure) {
    const std::int64_t peak = memory::stats(tier::host).peak;
    measured_ =
        non_model_bytes() + static_cast<std::size_t>(std::max<std::int64_t>(peak - in_use, 0));
    place_measured(measured_);
  }
  return r;
}

step_result offload_trainer::run_step(const trainer::batch_source& data) {
  auto t0 = std::chrono::steady_clock::now();
  pin_guard pins(tiers_);
  const std::int32_t n = chunk_count();
  const auto& all = model_->slots().slots();
  const int b = static_cast<int>(cfg_.batch), t = static_cast<int>(cfg_.seq);
  const std::int64_t ga = cfg_.grad_accum;
  grad_touched_.assign(n, false);
  std::vector<std::byte*> grad_at;  // backward: the gradient chunks of the current unit
  double sumsq = 0, loss = 0;
  step_result r;
  for (std::int64_t k = 0; k < ga; ++k) {
    const bool last = k == ga - 1;
    const std::uint64_t draw = cfg_.fixed_batch ? 0 : static_cast<std::uint64_t>(step_ * ga + k);
    data(draw, b, t, rows_);
    targets_.resize(rows_.size());
    tensor ids(rows_.data(), rows_.size() * 4, dtype::i32, {b, t});
    tensor tg(targets_.data(), targets_.size() * 4, dtype::i32, {b, t});
    next_token_targets(ids, tg);
    model_->begin(ids, tg);

    // Forward: each unit's parameter chunks on the device.
    for (std::int32_t u = 0; u < model_->units(); ++u) {
      for (std::int32_t c : unit_chunks_[u]) {
        std::byte* base = pins.acquire(c, tier::device);
        if (mixed()) {
          bind_mixed(u, c, base, nullptr);
          continue;
        }
        for (std::int32_t j : unit_tensors_[u])
          if (chunks_.layout.records[j].chunk == c) *all[param_slots_[j]].field = view(base, j);
      }
      model_->forward_unit(u);
      for (std::int32_t c : unit_chunks_[u]) pins.release(c, tier::device, false);
    }
    loss += model_->loss();

    // Backward: parameters and gradients on the device; gradients accumulate over the
    // micro-batches, and in the last one the norm is summed as they become final.
    for (std::int32_t u = model_->units() - 1; u >= 0; --u) {
      const auto& cs = unit_chunks_[u];
      grad_at.resize(cs.size());
      for (std::size_t ci = 0; ci < cs.size(); ++ci) {
        const std::int32_t c = cs[ci];
        std::byte* p = pins.acquire(c, tier::device);
        const bool first = !grad_touched_[c];
        std::byte* g = pins.acquire(n + c, tier::device, first);
        if (first) std::memset(g, 0, chunks_.layout.chunk_bytes);
        grad_touched_[c] = true;
        grad_at[ci] = g;
        if (mixed()) {
          bind_mixed(u, c, p, g);
          continue;
        }
        for (std::int32_t j : unit_tensors_[u])
          if (chunks_.layout.records[j].chunk == c) {
            *all[param_slots_[j]].field = view(p, j);
            *all[param_slots_[j]].grad = view(g, j);
          }
      }
      model_->backward_unit(u, 1.0);
      for (std::int32_t j : unit_tensors_[u]) {
        const std::int32_t c = chunks_.layout.records[j].chunk;
        const tensor gj = view(grad_at[std::find(cs.begin(), cs.end(), c) - cs.begin()], j);  // f32
        // bf16: the unit's bf16 gradient back into its f32 chunk (exact).
        if (mixed()) ops::copy(*all[param_slots_[j]].grad, gj);
        if (!last || last_backward_unit_[j] != u) continue;
        if (ga > 1) ops::scale(gj, 1.0 / static_cast<double>(ga));  // the mean loss's gradient
        sumsq += ops::sum_squares(gj);
      }
      for (std::int32_t c : unit_chunks_[u]) {
        pins.release(c, tier::device, false);
        pins.release(n + c, tier::device, true);
      }
    }
  }
  r.loss = loss / static_cast<double>(ga);

  // Clip and update chunk by chunk where each chunk's optimizer runs.
  r.grad_norm = std::sqrt(sumsq);
  const double clip = clip_factor(r.grad_norm, cfg_.clip);
  r.lr = warmup_cosine_lr(step_, cfg_.warmup, cfg_.steps, cfg_.lr, cfg_.min_lr);
  ops::adamw_options o{.lr = r.lr,
                       .beta1 = cfg_.beta1,
                       .beta2 = cfg_.beta2,
                       .eps = cfg_.eps,
                       .weight_decay = cfg_.weight_decay,
                       .step = step_ + 1};
  // Chunk i's update runs on a worker thread while this thread brings in chunk i + 1's four
  // chunks (NVMe reads, write-backs of evicted chunks, host <-> device copies), when the host
  // holds both groups at once (overlap_); else one after the other. The arithmetic is the same.
  struct group {
    std::int32_t i = -1;
    tier at = tier::host;
    std::byte* b[4] = {nullptr, nullptr, nullptr, nullptr};  // p, g, m, v
  };
  auto bring = [&](std::int32_t i) {
    group q{i, optim_at_[i]};
    for (int k = 0; k < 4; ++k) q.b[k] = pins.acquire(k * n + i, q.at);
    return q;
  };
  auto update = [&](const group& q) {
    for (std::int32_t j : chunks_.layout.members[q.i]) {
      tensor gj = view(q.b[1], j);
      if (clip != 1.0) ops::scale(gj, clip);
      ops::adamw_options oj = o;
      if (!decays_[j]) oj.weight_decay = 0.0;
      ops::adamw(view(q.b[0], j), gj, view(q.b[2], j), view(q.b[3], j), oj);
    }
  };
  auto put_back = [&](const group& q) {
    for (int k = 0; k < 4; ++k) pins.release(k * n + q.i, q.at, k != 1 || clip != 1.0);
  };
  if (!overlap_) {
    for (std::int32_t i = 0; i < n; ++i) {
      const group q = bring(i);
      update(q);
      put_back(q);
    }
  } else {
    group cur = bring(0);
    for (std::int32_t i = 0; i < n; ++i) {
      auto running = std::async(std::launch::async, [&update, cur] { update(cur); });
      group next;
      try {
        if (i + 1 < n) next = bring(i + 1);
      } catch (...) {
        running.wait();  // the update reads pinned chunks: finish it before they are released
        throw;
      }
      running.get();
      put_back(cur);
      cur = next;
    }
  }
  ++step_;
  r.step = step_;
  r.tokens = cfg_.batch * cfg_.seq * ga;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

}  // namespace troupe::models
