// moe_routing: the routing decision, dispatch and combine (see moe_routing.hpp). Row by row
// through the op API, so they run on any device.
#include "models/layers/moe_routing.hpp"

#include <algorithm>
#include <numeric>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

moe_routing route_tokens(const std::vector<double>& p, std::int64_t rows, std::int32_t n_expert,
                         std::int32_t top_k, bool norm_topk_prob, std::int64_t capacity,
                         double (*round)(double)) {
  TROUPE_CHECK(n_expert > 0 && top_k > 0 && top_k <= n_expert,
               "moe routing: top_k must be in 1..n_expert, got ", top_k, " of ", n_expert);
  TROUPE_CHECK(static_cast<std::int64_t>(p.size()) == rows * n_expert, "moe routing: ", p.size(),
               " probabilities for ", rows, " rows of ", n_expert, " experts");
  moe_routing r;
  r.rows = rows;
  r.top_k = top_k;
  r.experts.resize(static_cast<std::size_t>(n_expert));
  r.selected.assign(static_cast<std::size_t>(n_expert), 0);
  r.chosen.resize(static_cast<std::size_t>(rows * top_k));
  r.weights.resize(static_cast<std::size_t>(rows * top_k));
  std::vector<std::int32_t> order(static_cast<std::size_t>(n_expert));
  for (std::int64_t n = 0; n < rows; ++n) {
    const double* pn = p.data() + n * n_expert;
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](std::int32_t a, std::int32_t b) { return pn[a] > pn[b]; });
    double sum = 0;
    for (std::int32_t k = 0; k < top_k; ++k) sum += pn[order[k]];
    for (std::int32_t k = 0; k < top_k; ++k) {
      const auto at = static_cast<std::size_t>(n * top_k + k);
      r.chosen[at] = order[k];
      r.weights[at] = round(norm_topk_prob ? pn[order[k]] / sum : pn[order[k]]);
      ++r.selected[static_cast<std::size_t>(order[k])];
    }
  }
  // Choice by choice, token by token, up to each expert's capacity.
  for (std::int32_t k = 0; k < top_k; ++k)
    for (std::int64_t n = 0; n < rows; ++n) {
      const auto at = static_cast<std::size_t>(n * top_k + k);
      auto& list = r.experts[static_cast<std::size_t>(r.chosen[at])];
      if (capacity > 0 && static_cast<std::int64_t>(list.size()) >= capacity) {
        ++r.dropped;
        continue;
      }
      list.push_back({n, k, r.weights[at]});
    }
  return r;
}

namespace {

const std::vector<moe_assignment>& of(const moe_routing& r, std::int32_t e, const tensor& rows,
                                      const char* what) {
  TROUPE_CHECK(e >= 0 && e < static_cast<std::int32_t>(r.experts.size()), "moe ", what,
               ": no expert ", e);
  const auto& list = r.experts[static_cast<std::size_t>(e)];
  TROUPE_CHECK(rows.dim() == 2 && rows.size(0) >= static_cast<std::int64_t>(list.size()), "moe ",
               what, ": expert ", e, " has ", list.size(), " rows, its buffer is ",
               rows.describe());
  return list;
}

}  // namespace

void dispatch(const moe_routing& r, std::int32_t e, const tensor& x, const tensor& in) {
  const auto& list = of(r, e, in, "dispatch");
  for (std::size_t j = 0; j < list.size(); ++j)
    ops::copy(x.select(0, list[j].row), in.select(0, static_cast<std::int64_t>(j)));
}

void dispatch_backward(const moe_routing& r, std::int32_t e, const tensor& din, const tensor& dx) {
  const auto& list = of(r, e, din, "dispatch backward");
  for (std::size_t j = 0; j < list.size(); ++j)
    ops::axpy(1.0, din.select(0, static_cast<std::int64_t>(j)), dx.select(0, list[j].row));
}

void combine(const moe_routing& r, std::int32_t e, const tensor& out, const tensor& y) {
  const auto& list = of(r, e, out, "combine");
  for (std::size_t j = 0; j < list.size(); ++j)
    ops::axpy(list[j].weight, out.select(0, static_cast<std::int64_t>(j)),
              y.select(0, list[j].row));
}

std::vector<double> combine_backward(const moe_routing& r, std::int32_t e, const tensor& dy,
                                     const tensor& out, const tensor& dout, const tensor& tmp) {
  const auto& list = of(r, e, dout, "combine backward");
  std::vector<double> dweight(list.size());
  for (std::size_t j = 0; j < list.size(); ++j) {
    const auto jj = static_cast<std::int64_t>(j);
    const tensor dyn = dy.select(0, list[j].row);
    ops::mul(dyn, out.select(0, jj), tmp);
    dweight[j] = ops::sum(tmp);
    ops::copy(dyn, dout.select(0, jj));
    ops::scale(dout.select(0, jj), list[j].weight);
  }
  return dweight;
}

}  // namespace troupe::models
