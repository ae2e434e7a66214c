// balanced_partition(): minimise the most expensive contiguous part, exactly.
#include "scheduler/partition.hpp"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

namespace troupe::scheduler {

double partition::max_cost() const {
  return cost.empty() ? 0.0 : *std::max_element(cost.begin(), cost.end());
}

namespace {

void check(const layer_costs& c, int parts, const char* who) {
  const int n = static_cast<int>(c.layers.size());
  auto fail = [&](const std::string& what) {
    throw std::invalid_argument(std::string(who) + ": " + what);
  };
  if (parts < 1 || parts > n)
    fail("parts = " + std::to_string(parts) + " must be in [1, layers = " + std::to_string(n) +
         "]: every part needs a layer");
  for (int i = 0; i < n; ++i)
    if (!(c.layers[i] >= 0)) fail("the cost of layer " + std::to_string(i) + " is negative");
  if (!(c.embedding >= 0)) fail("the embedding cost is negative");
  if (!(c.head >= 0)) fail("the head cost is negative");
}

// Costs of candidate parts from prefix sums, so that the search and the result agree exactly.
struct costs {
  const layer_costs& c;
  int parts;
  std::vector<double> prefix;
  costs(const layer_costs& lc, int k) : c(lc), parts(k), prefix(lc.layers.size() + 1, 0.0) {
    for (std::size_t i = 0; i < lc.layers.size(); ++i) prefix[i + 1] = prefix[i] + lc.layers[i];
  }
  // Part `t` holding layers [i, j).
  double of(int t, int i, int j) const {
    double v = prefix[j] - prefix[i];
    if (t == 0) v += c.embedding;
    if (t == parts - 1) v += c.head;
    return v;
  }
  partition make(std::vector<int> first) const {
    partition p;
    p.first = std::move(first);
    for (int t = 0; t < parts; ++t) p.cost.push_back(of(t, p.first[t], p.first[t + 1]));
    return p;
  }
};

}  // namespace

partition balanced_partition(const layer_costs& c, int parts) {
  check(c, parts, "balanced_partition");
  const int n = static_cast<int>(c.layers.size());
  const costs cost(c, parts);
  constexpr double inf = std::numeric_limits<double>::infinity();
  // best[t][j]: the smallest possible maximum over parts 0..t-1 holding layers [0, j).
  std::vector<std::vector<double>> best(parts + 1, std::vector<double>(n + 1, inf));
  best[0][0] = 0;
  for (int t = 1; t <= parts; ++t)
    for (int j = t; j <= n - (parts - t); ++j)
      for (int i = t - 1; i < j; ++i)
        if (best[t - 1][i] < inf)
          best[t][j] = std::min(best[t][j], std::max(best[t - 1][i], cost.of(t - 1, i, j)));
  const double target = best[parts][n];
  // Walk back, giving each later part as few layers as the target allows.
  std::vector<int> first(parts + 1, 0);
  first[parts] = n;
  for (int t = parts; t >= 1; --t) {
    const int j = first[t];
    int i = j - 1;
    while (i >= t - 1 && !(best[t - 1][i] <= target && cost.of(t - 1, i, j) <= target)) --i;
    first[t - 1] = i;
  }
  return cost.make(std::move(first));
}

partition even_partition(const layer_costs& c, int parts) {
  check(c, parts, "even_partition");
  const int n = static_cast<int>(c.layers.size());
  std::vector<int> first(parts + 1, 0);
  for (int t = 0; t < parts; ++t) first[t + 1] = first[t] + n / parts + (t < n % parts ? 1 : 0);
  return costs(c, parts).make(std::move(first));
}

layer_costs transformer_costs(const model_shape& m, int tp) {
  auto need = [](long long v, const char* field) {
    if (v <= 0)
      throw std::invalid_argument(std::string("transformer_costs: model_shape.") + field +
                                  " must be > 0, got " + std::to_string(v));
  };
  need(m.layers, "layers");
  need(m.heads, "heads");
  need(m.kv_heads, "kv_heads");
  need(m.hidden, "hidden");
  need(m.vocab, "vocab");
  need(m.seq, "seq");
  if (tp <= 0)
    throw std::invalid_argument("transformer_costs: parallel.tp must be > 0, got " +
                                std::to_string(tp));
  const double c = static_cast<double>(m.hidden), t = static_cast<double>(m.seq);
  const double v = static_cast<double>(m.vocab);
  const double ffn = m.ffn > 0 ? static_cast<double>(m.ffn) : 4 * c;
  const double kv = c * static_cast<double>(m.kv_heads) / static_cast<double>(m.heads);
  // Weights of the block's matrix multiplications: q and o (C x C each), k and v (C x kv each),
  // the MLP (two C x ffn; three with a gate).
  const double mlp = (m.gated_mlp ? 3.0 : 2.0) * c * ffn;
  const double block = 2 * (2 * c * c + 2 * c * kv + mlp) + 4 * t * c;
  layer_costs out;
  out.layers.assign(static_cast<std::size_t>(m.layers), 3 * block / tp);
  out.embedding = 3 * c / tp;
  out.head = 3 * (2 * c * v + 5 * v) / tp;
  return out;
}

partition partition_layers(partition_kind kind, const model_shape& m, int parts, int tp) {
  const layer_costs costs = transformer_costs(m, tp);
  return kind == partition_kind::even ? even_partition(costs, parts)
                                      : balanced_partition(costs, parts);
}

}  // namespace troupe::scheduler
