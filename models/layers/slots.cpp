// Slot lists and the layer_memory that binds them (see slots.hpp).
#include "models/layers/slots.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>
#include <random>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

slot_list::scope slot_list::enter(std::string_view name) {
  scopes_.push_back({std::string(name), ++clock_, false, {}});
  return scope(this);
}

slot_list::scope slot_list::enter_recomputed(std::string_view name) {
  scopes_.push_back({std::string(name), ++clock_, true, {}});
  return scope(this);
}

void slot_list::leave() {
  std::int64_t closed = ++clock_;
  for (std::size_t i : scopes_.back().closing) slots_[i].last = closed;
  scopes_.pop_back();
}

std::string slot_list::prefix() const {
  std::string p;
  for (const auto& s : scopes_) {
    if (s.name.empty()) continue;
    if (!p.empty()) p += '.';
    p += s.name;
  }
  return p;
}

std::string slot_list::full_name(std::string_view name) const {
  std::string p = prefix();
  if (p.empty()) return std::string(name);
  return p + "." + std::string(name);
}

void slot_list::add(tensor_slot s) {
  s.block = block_;
  for (auto d : s.sizes)
    TROUPE_CHECK(d >= 0, "slot '", s.name, "': negative extent in ", s.sizes.str());
  for (const auto& o : slots_)
    TROUPE_CHECK(o.name != s.name, "slot '", s.name, "' is declared twice");
  slots_.push_back(std::move(s));
}

slot_list::block_mark slot_list::mark_block(std::int64_t index) {
  TROUPE_CHECK(index >= 0, "slot_list: block index ", index, " must be >= 0");
  block_mark m(this, block_);
  block_ = index;
  return m;
}

slot_list::expert_mark slot_list::mark_expert(std::int32_t index) {
  TROUPE_CHECK(index >= 0, "slot_list: expert index ", index, " must be >= 0");
  expert_mark m(this, expert_);
  expert_ = index;
  return m;
}

void slot_list::param(std::string_view name, const shape& sizes, tensor& value, tensor& grad,
                      param_spec spec) {
  if (expert_ >= 0) spec.expert = expert_;
  TROUPE_CHECK(!spec.split || (spec.axis >= 0 && spec.axis < sizes.rank()), "parameter '",
               full_name(name), "': split axis ", int(spec.axis), " is not an axis of ",
               sizes.str());
  if (spec.split && !spec.sections.empty()) {
    std::int64_t sum = 0;
    for (auto e : spec.sections) sum += e;
    TROUPE_CHECK(sum == sizes[spec.axis], "parameter '", full_name(name), "': sections add up to ",
                 sum, ", not to extent ", sizes[spec.axis], " of ", sizes.str());
  }
  tensor_slot s{slot_kind::param,
                full_name(name),
                sizes,
                &value,
                &grad,
                0,
                std::numeric_limits<std::int64_t>::max()};
  s.spec = std::move(spec);
  add(std::move(s));
}

// The slot is live from when `closes_with` opened until it closes (leave() fills in `last`).
void slot_list::add_closing(tensor_slot s, open_scope& closes_with) {
  s.first = closes_with.opened;
  add(std::move(s));
  closes_with.closing.push_back(slots_.size() - 1);
}

void slot_list::activation(std::string_view name, const shape& sizes, tensor& t) {
  tensor_slot s{slot_kind::activation,
                full_name(name),
                sizes,
                &t,
                nullptr,
                0,
                std::numeric_limits<std::int64_t>::max()};
  for (auto& o : scopes_)  // the outermost recomputed scope, if any
    if (o.recomputed) return add_closing(std::move(s), o);
  add(std::move(s));  // live for the whole step
}

void slot_list::scratch(std::string_view name, const shape& sizes, tensor& t) {
  tensor_slot s{slot_kind::scratch,
                full_name(name),
                sizes,
                &t,
                nullptr,
                0,
                std::numeric_limits<std::int64_t>::max()};
  if (scopes_.empty()) return add(std::move(s));  // outside every scope: the whole step
  add_closing(std::move(s), scopes_.back());
}

std::int64_t slot_list::param_count() const {
  std::int64_t n = 0;
  for (const auto& s : slots_)
    if (s.kind == slot_kind::param) n += s.sizes.numel();
  return n;
}

namespace {

constexpr std::size_t slot_alignment = 64;

memory::tier tier_of(device dev) {
  return dev.is_cpu() ? memory::tier::host : memory::tier::device;
}

struct planned {
  memory::memory_plan plan;
  memory::arena arena;
};

// The specs one after the other, in the order given (aligned).
memory::memory_plan in_order(const std::vector<memory::size_spec>& specs) {
  memory::memory_plan plan;
  for (const auto& s : specs) {
    std::size_t at = (plan.total + s.alignment - 1) / s.alignment * s.alignment;
    plan.blocks.push_back({s.name, at, s.bytes});
    plan.total = at + s.bytes;
  }
  plan.naive_total = plan.total;
  return plan;
}

std::vector<memory::size_spec> specs_of(const slot_list& slots, slot_kind kind, dtype t) {
  std::vector<memory::size_spec> specs;
  for (const auto& s : slots.slots()) {
    if (s.kind != kind) continue;
    specs.push_back({s.name, static_cast<std::size_t>(s.sizes.numel()) * dtype_size(t),
                     slot_alignment, s.first, s.last});
  }
  return specs;
}

planned plan_kind(const slot_list& slots, slot_kind kind, dtype t, device dev) {
  const auto specs = specs_of(slots, kind, t);
  planned p;
  if (specs.empty()) return p;
  // Parameters (and their gradients) in declaration order, so that a block's parameters are one
  // range of the flat buffer; on the host their pages can be given back (release_params).
  const bool params = kind == slot_kind::param;
  p.plan = params ? in_order(specs) : memory::plan_memory(specs);
  p.arena = memory::arena(p.plan, 0, tier_of(dev), params && dev.is_cpu());
  return p;
}

tensor bind(const memory::arena& a, const tensor_slot& s, dtype t, device dev) {
  std::size_t bytes = static_cast<std::size_t>(s.sizes.numel()) * dtype_size(t);
  return tensor(a.at(s.name), bytes, t, s.sizes, dev);
}

tensor flat(const memory::arena& a, dtype t, device dev) {
  if (a.capacity() == 0) return {};
  auto n = static_cast<std::int64_t>(a.capacity() / dtype_size(t));
  return tensor(a.base(), a.capacity(), t, {n}, dev);
}

std::mutex ledger_mu;  // guards ledger (param_bytes())
param_bytes_stats ledger;

}  // namespace

param_bytes_stats param_bytes() {
  std::lock_guard lk(ledger_mu);
  return ledger;
}

layer_memory::counted::counted(std::size_t bytes) : bytes_(bytes) {
  std::lock_guard lk(ledger_mu);
  ledger.in_use += static_cast<std::int64_t>(bytes);
  ledger.peak = std::max(ledger.peak, ledger.in_use);
}

layer_memory::counted& layer_memory::counted::operator=(counted&& o) noexcept {
  if (this != &o) {
    counted gone(std::move(*this));  // gives this one's bytes back
    bytes_ = o.bytes_;
    o.bytes_ = 0;
  }
  return *this;
}

layer_memory::counted::~counted() {
  if (bytes_ == 0) return;
  std::lock_guard lk(ledger_mu);
  ledger.in_use -= static_cast<std::int64_t>(bytes_);
}

param_placement place_params(const slot_list& slots, dtype t) {
  const auto specs = specs_of(slots, slot_kind::param, t);
  param_placement out;
  if (specs.empty()) return out;
  const auto plan = in_order(specs);
  const auto elem = static_cast<std::int64_t>(dtype_size(t));
  for (const auto& b : plan.blocks)
    out.offsets.push_back(static_cast<std::int64_t>(b.offset) / elem);
  // The arena's size (memory::arena): the plan's total rounded up to 64 bytes.
  out.numel = static_cast<std::int64_t>((plan.total + 63) / 64 * 64) / elem;
  return out;
}

void draw_init(const slot_list& slots, std::uint64_t seed, double std, double residual_scale,
               const init_sink& each) {
  std::mt19937_64 gen(seed);
  std::normal_distribution<double> normal(0.0, std);
  for (const auto& s : slots.slots()) {
    if (s.kind != slot_kind::param) continue;
    auto host = empty(s.sizes, dtype::f64);
    double* p = host.data_as<double>();
    for (std::int64_t i = 0; i < host.numel(); ++i) {
      switch (s.spec.init) {
        case param_init::normal:
          p[i] = normal(gen);
          if (s.spec.residual_out) p[i] *= residual_scale;
          break;
        case param_init::zeros:
          p[i] = 0.0;
          break;
        case param_init::ones:
          p[i] = 1.0;
          break;
      }
    }
    each(s, host);
  }
}

void store_param(const tensor_slot& slot, const tensor& values) {
  if (slot.field->type() == dtype::f64) {
    // An f64 model starts from the f32 model's weights exactly (the draws rounded to f32), so
    // that it is the exact-arithmetic reference of the f32 run from the same seed.
    auto f32 = empty(slot.sizes, dtype::f32);
    ops::copy(values, f32);
    auto wide = empty(slot.sizes, dtype::f64);
    ops::copy(f32, wide);
    store_param_as_is(slot, wide);
    return;
  }
  store_param_as_is(slot, values);
}

void store_param_as_is(const tensor_slot& slot, const tensor& values) {
  if (slot.field->is_cpu()) {
    ops::copy(values, *slot.field);
    return;
  }
  auto conv = empty(slot.sizes, slot.field->type());
  ops::copy(values, conv);
  auto dev = to_device(conv, slot.field->dev());
  ops::copy(dev, *slot.field);
}

layer_memory::layer_memory(const slot_list& slots, dtype t, device dev) {
  TROUPE_CHECK(is_floating(t), "layer_memory: layers need a floating dtype, got ", dtype_name(t));
  planned p = plan_kind(slots, slot_kind::param, t, dev);
  planned g = plan_kind(slots, slot_kind::param, t, dev);
  planned a = plan_kind(slots, slot_kind::activation, t, dev);
  planned s = plan_kind(slots, slot_kind::scratch, t, dev);
  params_ = std::move(p.arena);
  grads_ = std::move(g.arena);
  activations_ = std::move(a.arena);
  scratch_ = std::move(s.arena);
  scratch_naive_ = s.plan.naive_total;
  param_share_ = counted(params_.capacity());
  params_flat_ = flat(params_, t, dev);
  grads_flat_ = flat(grads_, t, dev);
  for (const auto& slot : slots.slots()) {
    switch (slot.kind) {
      case slot_kind::param:
        *slot.field = bind(params_, slot, t, dev);
        *slot.grad = bind(grads_, slot, t, dev);
        break;
      case slot_kind::activation:
        *slot.field = bind(activations_, slot, t, dev);
        break;
      case slot_kind::scratch:
        *slot.field = bind(scratch_, slot, t, dev);
        break;
    }
  }
  // Zero parameters and gradients, padding included, so flat views hold no garbage.
  if (params_flat_.defined()) ops::fill(params_flat_, 0.0);
  zero_grads();
}

std::size_t layer_memory::release_params(std::int64_t first, std::int64_t count) {
  TROUPE_CHECK(first >= 0 && count >= 0 && first + count <= params_flat_.numel(),
               "layer_memory::release_params: elements [", first, ", +", count,
               ") are outside the ", params_flat_.numel(), " parameter elements");
  const std::size_t elem = params_flat_.element_size();
  return params_.release_pages(static_cast<std::size_t>(first) * elem,
                               static_cast<std::size_t>(count) * elem);
}

std::size_t layer_memory::resident_param_bytes() const {
  return params_.capacity() == 0 ? 0 : params_.resident_bytes();
}

std::size_t layer_memory::release_grads(std::int64_t first, std::int64_t count) {
  TROUPE_CHECK(first >= 0 && count >= 0 && first + count <= grads_flat_.numel(),
               "layer_memory::release_grads: elements [", first, ", +", count, ") are outside the ",
               grads_flat_.numel(), " gradient elements");
  if (count == 0) return 0;
  const std::size_t elem = grads_flat_.element_size();
  const std::size_t begin = static_cast<std::size_t>(first) * elem;
  const std::size_t end = begin + static_cast<std::size_t>(count) * elem;
  const std::size_t given = grads_.release_pages(begin, end - begin);
  if (!grads_flat_.is_cpu() || given == 0) {
    ops::fill(grads_flat_.narrow(0, first, count), 0.0);
    return given;
  }
  // The whole pages given back start at the first page boundary at or after `begin` (the
  // buffer's base is page-aligned); zero what lies before and after them.
  const std::size_t page = ::sysconf(_SC_PAGESIZE) > 0
                               ? static_cast<std::size_t>(::sysconf(_SC_PAGESIZE))
                               : std::size_t{4096};
  const std::size_t lo = (begin + page - 1) / page * page, hi = lo + given;
  char* base = static_cast<char*>(grads_flat_.data());
  std::memset(base + begin, 0, lo - begin);
  std::memset(base + hi, 0, end - hi);
  return given;
}

std::size_t layer_memory::resident_grad_bytes() const {
  return grads_.capacity() == 0 ? 0 : grads_.resident_bytes();
}

void layer_memory::zero_grads() const {
  if (grads_flat_.defined()) ops::fill(grads_flat_, 0.0);
}

// ---- helpers ---------------------------------------------------------------------------------

std::string describe(const tensor& t) {
  return t.defined() ? t.describe() : "undefined";
}

shape with_last(shape s, std::int64_t last) {
  if (s.rank() == 0) return {last};
  s[s.rank() - 1] = last;
  return s;
}

std::int64_t leading_rows(const shape& s) {
  std::int64_t n = 1;
  for (int i = 0; i + 1 < s.rank(); ++i) n *= s[i];
  return n;
}

tensor planned_view(const tensor& planned, const shape& sizes, std::string_view layer,
                    std::string_view what) {
  TROUPE_CHECK(planned.defined(), layer, ": '", what,
               "' is not bound (declare the layer and build its layer_memory first)");
  TROUPE_CHECK(sizes.numel() <= planned.numel(), layer, ": '", what, "' needs ", sizes.str(),
               " but memory was planned for ", planned.sizes().str(),
               " (the batch is larger than the one declared)");
  return tensor(planned.data(), planned.nbytes(), planned.type(), sizes, planned.dev());
}

}  // namespace troupe::models
