// moe_ffn: router, routing, experts, shared expert; forward and backward (see moe_ffn.hpp).
#include "models/layers/moe_ffn.hpp"

#include <cmath>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {

// The values of a tensor on the host, as doubles.
std::vector<double> host_values(const tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  if (t.is_cpu() && t.is_contiguous() && t.type() == dtype::f64) {
    const double* p = t.data_as<double>();
    v.assign(p, p + t.numel());
  } else if (t.is_cpu() && t.is_contiguous() && t.type() == dtype::f32) {
    const float* p = t.data_as<float>();
    for (std::int64_t i = 0; i < t.numel(); ++i) v[i] = p[i];
  } else {
    owned_tensor wide = empty(t.sizes(), dtype::f64);
    if (t.is_cpu()) {
      ops::copy(t, wide);
    } else {
      owned_tensor same = empty(t.sizes(), t.type());
      ops::copy(to_device(t, device::cpu()), same);
      ops::copy(same, wide);
    }
    const double* p = wide.data_as<double>();
    v.assign(p, p + t.numel());
  }
  return v;
}

// `v` into a contiguous tensor t (rounded to its dtype).
void store_values(const std::vector<double>& v, const tensor& t) {
  if (t.is_cpu() && t.type() == dtype::f64) {
    double* p = t.data_as<double>();
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = v[i];
  } else if (t.is_cpu() && t.type() == dtype::f32) {
    float* p = t.data_as<float>();
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = static_cast<float>(v[i]);
  } else {
    owned_tensor wide = empty(t.sizes(), dtype::f64);
    double* p = wide.data_as<double>();
    for (std::int64_t i = 0; i < t.numel(); ++i) p[i] = v[i];
    owned_tensor same = empty(t.sizes(), t.type());
    ops::copy(wide, same);
    ops::copy(t.is_cpu() ? static_cast<const tensor&>(same) : to_device(same, t.dev()), t);
  }
}

double keep(double v) {
  return v;
}
double to_f32(double v) {
  return static_cast<double>(static_cast<float>(v));
}

}  // namespace

moe_ffn::moe_ffn(const config& c)
    : cfg(c),
      gate({c.dim, c.n_expert, false, tp_split::none}),
      shared_expert(c.shared_hidden > 0 ? swiglu_mlp({.dim = c.dim, .hidden = c.shared_hidden})
                                        : swiglu_mlp()),
      shared_expert_gate({c.dim, 1, false, tp_split::none}) {
  experts.reserve(static_cast<std::size_t>(std::max(local_experts(), 0)));
  for (std::int32_t e = 0; e < local_experts(); ++e)
    experts.emplace_back(swiglu_mlp::config{.dim = c.dim, .hidden = c.hidden});
}

moe_ffn::host_state moe_ffn::save() const {
  host_state s{routing, prob_sum, p_, sigmoid_, served, received, rows_, {}};
  for (const auto& e : experts)
    for (const linear* l : {&e.gate_proj, &e.up_proj, &e.down_proj})
      s.expert_inputs.push_back(l->x);
  return s;
}

void moe_ffn::restore(const host_state& s) {
  routing = s.routing;
  prob_sum = s.prob_sum;
  p_ = s.p;
  sigmoid_ = s.sigmoid;
  served = s.served;
  received = s.received;
  rows_ = s.rows;
  std::size_t i = 0;
  for (auto& e : experts)
    for (linear* l : {&e.gate_proj, &e.up_proj, &e.down_proj}) l->x = s.expert_inputs.at(i++);
}

std::int64_t moe_ffn::capacity(std::int64_t rows) const {
  if (cfg.capacity_factor <= 0) return rows;
  const double want = std::ceil(cfg.capacity_factor * static_cast<double>(rows * cfg.top_k) /
                                static_cast<double>(cfg.n_expert));
  return std::max<std::int64_t>(1, std::min(rows, static_cast<std::int64_t>(want)));
}

void moe_ffn::declare(slot_list& s, std::string_view name, batch_dims b) {
  TROUPE_CHECK(cfg.dim > 0 && cfg.hidden > 0 && cfg.n_expert > 0 && cfg.top_k > 0 &&
                   cfg.top_k <= cfg.n_expert && cfg.shared_hidden >= 0 && cfg.capacity_factor >= 0,
               "moe_ffn '", name,
               "': dim, hidden and n_expert must be > 0, top_k in 1..n_expert, shared_hidden and "
               "capacity_factor >= 0, got ",
               cfg.dim, ", ", cfg.hidden, ", ", cfg.n_expert, ", ", cfg.top_k, ", ",
               cfg.shared_hidden, ", ", cfg.capacity_factor);
  TROUPE_CHECK(cfg.ep >= 1 && cfg.n_expert % cfg.ep == 0 && cfg.ep_rank >= 0 &&
                   cfg.ep_rank < cfg.ep && (cfg.ep == 1 || cfg.capacity_factor == 0),
               "moe_ffn '", name, "': expert parallelism ep ", cfg.ep, " (rank ", cfg.ep_rank,
               ") must divide n_expert ", cfg.n_expert,
               " and is dropless only (capacity_factor 0, got ", cfg.capacity_factor, ")");
  auto scope = s.enter(name);
  label = "moe_ffn '" + s.prefix() + "'";
  const std::int64_t rows = b.rows(), c = cfg.dim;
  // A local expert serves each rank's tokens at most once (dropless) under expert parallelism.
  const std::int64_t cap = cfg.ep > 1 ? cfg.ep * rows : capacity(rows);
  gate.declare(s, "gate", b);
  expert_in.resize(experts.size());
  expert_out.resize(experts.size());
  for (std::size_t j = 0; j < experts.size(); ++j) {
    const std::int32_t e = first_expert() + static_cast<std::int32_t>(j);
    const auto mark = s.mark_expert(e);
    experts[j].declare(s, "experts." + std::to_string(e), {cap, 1});
    s.activation("expert_in." + std::to_string(e), {cap, c}, expert_in[j]);
    s.activation("expert_out." + std::to_string(e), {cap, c}, expert_out[j]);
  }
  if (cfg.ep > 1) {
    // Dropless: rows x top_k choices go out; at most min(top_k, local experts) per token of each
    // rank come in.
    const std::int64_t out = rows * cfg.top_k;
    const std::int64_t in = cfg.ep * rows * std::min<std::int64_t>(cfg.top_k, local_experts());
    s.activation("ep_out", {out, c}, ep_out);
    s.scratch("ep_send", {out, c}, ep_send);
    s.scratch("ep_recv", {in, c}, ep_recv);
  }
  s.activation("logits", {rows, cfg.n_expert}, logits);
  s.activation("probs", {rows, cfg.n_expert}, probs);
  s.scratch("dexpert_out", {cap, c}, dexpert_out);
  s.scratch("dexpert_in", {cap, c}, dexpert_in);
  s.scratch("dprobs", {rows, cfg.n_expert}, dprobs);
  s.scratch("dlogits", {rows, cfg.n_expert}, dlogits);
  s.scratch("drow", {c}, drow);
  if (cfg.shared_hidden > 0) {
    shared_expert.declare(s, "shared_expert", b);
    shared_expert_gate.declare(s, "shared_expert_gate", b);
    s.activation("shared_out", {rows, c}, shared_out);
    s.activation("shared_logit", {rows, 1}, shared_logit);
    s.scratch("dshared", {rows, c}, dshared);
    s.scratch("dshared_x", {rows, c}, dshared_x);
    s.scratch("dshared_logit", {rows, 1}, dshared_logit);
  }
}

void moe_ffn::forward(const tensor& x, const tensor& y) {
  TROUPE_CHECK(
      x.defined() && x.dim() >= 1 && x.size(-1) == cfg.dim && y.defined() && y.sizes() == x.sizes(),
      label, ": x and y must be [..., ", cfg.dim, "], got ", describe(x), " and ", describe(y));
  const std::int64_t rows = leading_rows(x.sizes()), c = cfg.dim, ne = cfg.n_expert;
  const tensor xr = x.reshape({rows, c}), yr = y.reshape({rows, c});
  const tensor lg = planned_view(logits, {rows, ne}, label, "logits");
  const tensor pr = planned_view(probs, {rows, ne}, label, "probs");
  gate.forward(xr, lg);
  ops::softmax(lg, pr);
  p_ = host_values(pr);
  rows_ = rows;
  routing = route_tokens(p_, rows, cfg.n_expert, cfg.top_k, cfg.norm_topk_prob,
                         cfg.capacity_factor > 0 ? capacity(rows) : 0,
                         x.type() == dtype::f64 ? keep : to_f32);
  prob_sum.assign(static_cast<std::size_t>(ne), 0.0);
  for (std::int64_t n = 0; n < rows; ++n)
    for (std::int64_t e = 0; e < ne; ++e) prob_sum[e] += p_[n * ne + e];

  ops::fill(yr, 0.0);
  experts_forward(xr, yr);
  if (cfg.shared_hidden == 0) return;
  const tensor so = planned_view(shared_out, {rows, c}, label, "shared_out");
  const tensor sl = planned_view(shared_logit, {rows, 1}, label, "shared_logit");
  shared_expert.forward(xr, so);
  shared_expert_gate.forward(xr, sl);
  sigmoid_ = host_values(sl);
  const auto round = x.type() == dtype::f64 ? keep : to_f32;
  for (std::int64_t n = 0; n < rows; ++n) {
    sigmoid_[n] = round(1.0 / (1.0 + std::exp(-sigmoid_[n])));
    ops::axpy(sigmoid_[n], so.select(0, n), yr.select(0, n));
  }
}

void moe_ffn::experts_forward(const tensor& xr, const tensor& yr) {
  if (cfg.ep > 1) {
    ep_forward(xr, yr);
    return;
  }
  const std::int64_t c = cfg.dim;
  served.assign(experts.size(), 0);
  for (std::int32_t e = 0; e < cfg.n_expert; ++e) {
    const auto count = static_cast<std::int64_t>(routing.experts[e].size());
    served[e] = count;
    if (count == 0) continue;
    const tensor in = planned_view(expert_in[e], {count, c}, label, "expert_in");
    const tensor out = planned_view(expert_out[e], {count, c}, label, "expert_out");
    dispatch(routing, e, xr, in);
    experts[e].forward(in, out);
    combine(routing, e, out, yr);
  }
}

void moe_ffn::experts_backward(const tensor& dyr, const tensor& dxr, const tensor& tmp,
                               std::vector<double>& dweight) {
  if (cfg.ep > 1) {
    ep_backward(dyr, dxr, tmp, dweight);
    return;
  }
  const std::int64_t c = cfg.dim, k = cfg.top_k;
  for (std::int32_t e = 0; e < cfg.n_expert; ++e) {
    const auto& list = routing.experts[e];
    const auto count = static_cast<std::int64_t>(list.size());
    if (count == 0) continue;
    const tensor out = planned_view(expert_out[e], {count, c}, label, "expert_out");
    const tensor dout = planned_view(dexpert_out, {count, c}, label, "dexpert_out");
    const tensor din = planned_view(dexpert_in, {count, c}, label, "dexpert_in");
    const std::vector<double> dw = combine_backward(routing, e, dyr, out, dout, tmp);
    for (std::size_t j = 0; j < list.size(); ++j) dweight[list[j].row * k + list[j].choice] = dw[j];
    experts[e].backward(dout, din);
    dispatch_backward(routing, e, din, dxr);
  }
}

void moe_ffn::backward(const tensor& dy, const tensor& dx) {
  TROUPE_CHECK(rows_ > 0, label, ": backward called before forward");
  const std::int64_t rows = rows_, c = cfg.dim, ne = cfg.n_expert, k = cfg.top_k;
  TROUPE_CHECK(dy.defined() && dx.defined() && leading_rows(dy.sizes()) == rows &&
                   dy.size(-1) == c && dx.sizes() == dy.sizes() && dx.data() != dy.data(),
               label, ": dy and dx must be [", rows, " rows, ", c, "] and must not alias, got ",
               describe(dy), " and ", describe(dx));
  const tensor dyr = dy.reshape({rows, c}), dxr = dx.reshape({rows, c});
  const tensor tmp = planned_view(drow, {c}, label, "drow");

  // The experts, and d(routing weight) of every served choice.
  std::vector<double> dweight(static_cast<std::size_t>(rows * k), 0.0);
  ops::fill(dxr, 0.0);
  experts_backward(dyr, dxr, tmp, dweight);

  // d p: through the renormalisation w_i = p_i / S (S the chosen p's sum), then the aux loss's.
  std::vector<double> dp(static_cast<std::size_t>(rows * ne), 0.0);
  for (std::int64_t n = 0; n < rows; ++n) {
    const std::int32_t* chosen = routing.chosen.data() + n * k;
    const double* dw = dweight.data() + n * k;
    double* dpn = dp.data() + n * ne;
    if (cfg.norm_topk_prob) {
      double sum = 0, dot = 0;
      for (std::int32_t i = 0; i < k; ++i) sum += p_[n * ne + chosen[i]];
      for (std::int32_t i = 0; i < k; ++i) dot += dw[i] * p_[n * ne + chosen[i]] / sum;
      for (std::int32_t i = 0; i < k; ++i) dpn[chosen[i]] += (dw[i] - dot) / sum;
    } else {
      for (std::int32_t i = 0; i < k; ++i) dpn[chosen[i]] += dw[i];
    }
    if (!aux_dprob.empty())
      for (std::int64_t e = 0; e < ne; ++e) dpn[e] += aux_dprob[e];
  }
  const tensor dpr = planned_view(dprobs, {rows, ne}, label, "dprobs");
  const tensor dlg = planned_view(dlogits, {rows, ne}, label, "dlogits");
  store_values(dp, dpr);
  ops::softmax_backward(planned_view(probs, {rows, ne}, label, "probs"), dpr, dlg);
  gate.backward(dlg, dxr, /*accumulate_dx=*/true);

  if (cfg.shared_hidden == 0) return;
  // y += s_n * shared(x)_n with s = sigmoid(shared_expert_gate(x)).
  const tensor so = planned_view(shared_out, {rows, c}, label, "shared_out");
  const tensor ds = planned_view(dshared, {rows, c}, label, "dshared");
  const tensor dsx = planned_view(dshared_x, {rows, c}, label, "dshared_x");
  std::vector<double> dlogit(static_cast<std::size_t>(rows));
  for (std::int64_t n = 0; n < rows; ++n) {
    const tensor dyn = dyr.select(0, n);
    ops::mul(dyn, so.select(0, n), tmp);
    dlogit[n] = ops::sum(tmp) * sigmoid_[n] * (1.0 - sigmoid_[n]);
    ops::copy(dyn, ds.select(0, n));
    ops::scale(ds.select(0, n), sigmoid_[n]);
  }
  const tensor dsl = planned_view(dshared_logit, {rows, 1}, label, "dshared_logit");
  store_values(dlogit, dsl);
  shared_expert.backward(ds, dsx);
  ops::add(dxr, dsx, dxr);
  shared_expert_gate.backward(dsl, dxr, /*accumulate_dx=*/true);
}

}  // namespace troupe::models
