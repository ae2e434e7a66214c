// moe_stage: the MoE family's parts for placements, the router statistics between stages, and
// stage<moe_family> instantiated (see moe_stage.hpp).
#include "models/parallel/moe_stage.hpp"

#include <cstring>

#include "memory/error.hpp"

namespace troupe::models {

moe_config tp_parts<moe_family>::checked(const moe_config& c, const tp_group& tp,
                                         std::string_view who) {
  TROUPE_CHECK(tp.size() == 1, who, ": parallel.tp ", tp.size(),
               ": the MoE family has no tensor-parallel placement yet (its experts are not split "
               "over tensor shards; use parallel.tp 1 with parallel.pp, parallel.dp, parallel.ep)");
  return moe_family::checked(c);
}

scheduler::model_shape tp_parts<moe_family>::shape(const moe_config& c) {
  return {.layers = c.n_layer,
          .heads = c.n_head,
          .kv_heads = c.n_kv_head > 0 ? c.n_kv_head : c.n_head,
          .hidden = c.dim,
          .vocab = c.vocab,
          .ffn = c.expert_hidden,
          .gated_mlp = true,
          .experts = c.n_expert};
}

template class tp_trunk<moe_family>;

}  // namespace troupe::models

namespace troupe::models::parallel {

namespace {

using totals = stage_side<moe_family>::totals;

// The extra sample of a boundary tensor, where the totals' f64 values are stored as bytes.
std::byte* extra_bytes(const tensor& t) {
  return static_cast<std::byte*>(t.narrow(0, t.size(0) - 1, 1).data());
}

// The f64 values of a boundary's extra sample: forward rows, selected[n], prob_sum[n]; backward
// rows, the microbatch's weight, selected[n].
void write(const tensor& t, const std::vector<double>& v) {
  std::memcpy(extra_bytes(t), v.data(), v.size() * sizeof(double));
}

std::vector<double> read(const tensor& t, std::size_t n) {
  std::vector<double> v(n);
  std::memcpy(v.data(), extra_bytes(t), n * sizeof(double));
  return v;
}

template <class Fn>
void each_layer(tp_trunk<moe_family>& trunk, block_span span, Fn&& fn) {
  for (std::int64_t i = span.first; i < span.end; ++i) fn(trunk.block(i)->mlp);
}

}  // namespace

stage_side<moe_family>::stage_side(const moe_config& c, int chunks)
    : n_expert_(c.n_expert),
      coef_(c.router_aux_loss_coef),
      with_aux_(c.aux_loss),
      live_(static_cast<std::size_t>(chunks)),
      saved_(static_cast<std::size_t>(chunks)) {}

shape stage_side<moe_family>::boundary(const shape& rows, dtype, const std::string& who) {
  TROUPE_CHECK(rows.rank() == 3, who, ": the boundary must be [B, T, C], got ", rows.str());
  return {rows[0] + 1, rows[1], rows[2]};  // forward checks the extra sample's bytes
}

double stage_side<moe_family>::forward(tp_trunk<moe_family>& trunk, block_span span, int chunk,
                                       const tensor& in, const tensor& y) {
  const auto ne = static_cast<std::size_t>(n_expert_);
  for (const tensor* t : {&in, &y})
    if (t->defined())
      TROUPE_CHECK(t->narrow(0, 0, 1).nbytes() >= (2 + 2 * ne) * sizeof(double), trunk.who(),
                   ": one sample of the boundary holds ", t->narrow(0, 0, 1).nbytes(),
                   " bytes, too few for the router statistics of ", n_expert_,
                   " experts (raise train.seq)");
  totals t;
  if (in.defined()) {
    const std::vector<double> v = read(in, 1 + 2 * ne);
    t.rows = v[0];
    t.selected.assign(v.begin() + 1, v.begin() + 1 + ne);
    t.prob_sum.assign(v.begin() + 1 + ne, v.end());
  } else {
    t.selected.assign(ne, 0.0);
    t.prob_sum.assign(ne, 0.0);
  }
  // In layer order, as moe_ends::head sums them.
  each_layer(trunk, span, [&](moe_ffn& l) {
    t.rows += static_cast<double>(l.routing.rows);
    for (std::size_t e = 0; e < ne; ++e) {
      t.selected[e] += static_cast<double>(l.routing.selected[e]);
      t.prob_sum[e] += l.prob_sum[e];
    }
  });
  if (y.defined()) {
    std::vector<double> v{t.rows};
    v.insert(v.end(), t.selected.begin(), t.selected.end());
    v.insert(v.end(), t.prob_sum.begin(), t.prob_sum.end());
    write(y, v);
  }
  live_[static_cast<std::size_t>(chunk)] = t;
  if (!span.back || !with_aux_ || t.rows == 0) return 0;
  double aux = 0;
  for (std::size_t e = 0; e < ne; ++e) aux += (t.selected[e] / t.rows) * (t.prob_sum[e] / t.rows);
  return coef_ * aux * static_cast<double>(ne);
}

void stage_side<moe_family>::backward(tp_trunk<moe_family>& trunk, block_span span, int chunk,
                                      const tensor& dy, const tensor& dx, double weight) {
  // The weight is the last virtual stage's (pipeline_stage keeps a microbatch's weight there).
  const auto ne = static_cast<std::size_t>(n_expert_);
  std::vector<double> v;
  if (dy.defined()) {
    v = read(dy, 2 + ne);
  } else {
    const totals& t = live_[static_cast<std::size_t>(chunk)];
    v = {t.rows, weight};
    v.insert(v.end(), t.selected.begin(), t.selected.end());
  }
  if (dx.defined()) write(dx, v);
  const double m = v[0], w = v[1];
  each_layer(trunk, span, [&](moe_ffn& l) {
    l.aux_dprob.clear();
    if (!with_aux_ || m == 0) return;
    for (std::size_t e = 0; e < ne; ++e)
      l.aux_dprob.push_back(w * coef_ * static_cast<double>(ne) * v[2 + e] / (m * m));
  });
}

void stage_side<moe_family>::save(tp_trunk<moe_family>& trunk, block_span span, int chunk,
                                  std::size_t slot) {
  auto& all = saved_[static_cast<std::size_t>(chunk)];
  if (all.size() <= slot) all.resize(slot + 1);
  kept& k = all[slot];
  k.at = live_[static_cast<std::size_t>(chunk)];
  k.layers.clear();
  each_layer(trunk, span, [&](moe_ffn& l) { k.layers.push_back(l.save()); });
}

void stage_side<moe_family>::restore(tp_trunk<moe_family>& trunk, block_span span, int chunk,
                                     std::size_t slot) {
  const kept& k = saved_[static_cast<std::size_t>(chunk)].at(slot);
  live_[static_cast<std::size_t>(chunk)] = k.at;
  std::size_t j = 0;
  each_layer(trunk, span, [&](moe_ffn& l) { l.restore(k.layers.at(j++)); });
}

template class stage<moe_family>;

void set_expert_exchange(moe_stage& s, moe_exchange* x) {
  for (std::int64_t i = 0; i < s.config().n_layer; ++i)
    if (auto* b = s.parts().block(i)) b->mlp.exchange = x;
}

}  // namespace troupe::models::parallel
