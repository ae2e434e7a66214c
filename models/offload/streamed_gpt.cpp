// streamed_gpt (see streamed_gpt.hpp): gpt's forward and backward cut at unit boundaries.
#include "models/offload/streamed_gpt.hpp"

#include <string>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

// Plans the slots of one kind (activations or scratch) as layer_memory does and binds them.
memory::arena plan_and_bind(const slot_list& slots, slot_kind kind) {
  std::vector<memory::size_spec> specs;
  for (const auto& s : slots.slots())
    if (s.kind == kind)
      specs.push_back({s.name, static_cast<std::size_t>(s.sizes.numel()) * 4, 64, s.first, s.last});
  if (specs.empty()) return {};
  memory::arena a(memory::plan_memory(specs), 0, memory::tier::host);
  for (const auto& s : slots.slots())
    if (s.kind == kind)
      *s.field = tensor(a.at(s.name), static_cast<std::size_t>(s.sizes.numel()) * 4, dtype::f32,
                        s.sizes, device::cpu());
  return a;
}

bool starts_with(const std::string& s, std::string_view p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}

}  // namespace

streamed_gpt::streamed_gpt(const gpt_config& cfg, batch_dims dims)
    : cfg_(cfg), dims_(dims), ends_(cfg) {
  TROUPE_CHECK(cfg.vocab > 0 && cfg.dim > 0 && cfg.n_layer > 0 && cfg.n_head > 0 &&
                   cfg.dim % cfg.n_head == 0 && dims.seq <= cfg.max_seq,
               "streamed_gpt: bad config (vocab, dim, n_layer, n_head > 0, dim % n_head == 0, ",
               "seq <= max_seq)");
  TROUPE_CHECK(!cfg.recompute, "streamed_gpt: recompute is not supported");
  h_.reserve(cfg.n_layer);
  for (std::int64_t i = 0; i < cfg.n_layer; ++i)
    h_.emplace_back(gpt_block::config{
        .dim = cfg.dim, .n_head = cfg.n_head, .ln_eps = cfg.ln_eps, .hidden = cfg.hidden});
  x_.resize(cfg.n_layer + 1);
  // The same declarations, in the same order, as gpt's constructor.
  shape bt{dims.batch, dims.seq, cfg.dim};
  ends_.declare_front(slots_, dims);
  for (std::int64_t i = 0; i < cfg.n_layer; ++i) {
    slots_.activation("x." + std::to_string(i), bt, x_[i]);
    const auto mark = slots_.mark_block(i);
    h_[i].declare(slots_, "h." + std::to_string(i), dims, false);
  }
  slots_.activation("x." + std::to_string(cfg.n_layer), bt, x_[cfg.n_layer]);
  ends_.declare_back(slots_, dims);
  activations_ = plan_and_bind(slots_, slot_kind::activation);
  scratch_ = plan_and_bind(slots_, slot_kind::scratch);

  pos_ids_ = empty({cfg.max_seq}, dtype::i32);
  for (std::int64_t i = 0; i < cfg.max_seq; ++i)
    pos_ids_.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(i);

  const auto n = static_cast<std::int32_t>(cfg.n_layer);
  unit_params_.resize(static_cast<std::size_t>(n) + 2);
  const auto& all = slots_.slots();
  for (std::size_t i = 0; i < all.size(); ++i) {
    const auto& s = all[i];
    if (s.kind != slot_kind::param) continue;
    const auto idx = static_cast<std::int32_t>(i);
    if (starts_with(s.name, "wte.") || starts_with(s.name, "wpe.")) {
      unit_params_[0].push_back(idx);
      if (starts_with(s.name, "wte.")) unit_params_[n + 1].push_back(idx);  // the tied head
    } else if (starts_with(s.name, "ln_f.")) {
      unit_params_[n + 1].push_back(idx);
    } else {
      TROUPE_CHECK(starts_with(s.name, "h."), "streamed_gpt: unexpected parameter ", s.name);
      auto dot = s.name.find('.', 2);
      unit_params_[1 + std::stoi(s.name.substr(2, dot - 2))].push_back(idx);
    }
  }
}

const std::vector<std::int32_t>& streamed_gpt::unit_params(std::int32_t u) const {
  TROUPE_CHECK(u >= 0 && u < units(), "streamed_gpt: no unit ", u, " (", units(), " units)");
  return unit_params_[static_cast<std::size_t>(u)];
}

void streamed_gpt::begin(const tensor& ids, const tensor& targets) {
  TROUPE_CHECK(ids.dim() == 2 && ids.type() == dtype::i32 && targets.sizes() == ids.sizes(),
               "streamed_gpt: ids and targets must be i32 [B, T], got ", ids.describe(), " and ",
               targets.describe());
  b_ = ids.size(0);
  t_ = ids.size(1);
  TROUPE_CHECK(b_ <= dims_.batch && t_ <= dims_.seq, "streamed_gpt: batch [", b_, ", ", t_,
               "] exceeds the planned [", dims_.batch, ", ", dims_.seq, "]");
  ids_ = ids;
  targets_ = targets;
}

void streamed_gpt::forward_unit(std::int32_t u) {
  shape bt{b_, t_, cfg_.dim};
  auto x = [&](std::int64_t i) { return planned_view(x_[i], bt, "streamed_gpt", "x"); };
  const std::int64_t n = cfg_.n_layer;
  if (u == 0)
    ends_.embed(ids_, pos_ids_.narrow(0, 0, t_), x(0));
  else if (u <= n)
    h_[u - 1].forward(x(u - 1), x(u));
  else
    loss_value_ = ends_.head(x(n), targets_);
}

void streamed_gpt::backward_unit(std::int32_t u, double loss_scale) {
  const std::int64_t n = cfg_.n_layer;
  if (u == n + 1) {
    ends_.head_backward(loss_scale, db_, da_);
  } else if (u >= 1) {
    h_[u - 1].backward(db_, da_);
    std::swap(da_, db_);
  } else {
    ends_.embed_backward(db_);
  }
}

}  // namespace troupe::models
