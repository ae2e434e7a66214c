// Stage partitioning against brute force over every contiguous split of small models.
#include <catch2/catch.hpp>

#include <algorithm>
#include <random>
#include <stdexcept>

#include "scheduler/partition.hpp"

using namespace troupe::scheduler;

namespace {

// The smallest maximum part cost over every split of the layers into `parts` non-empty runs.
double brute_force(const layer_costs& c, int parts) {
  const int n = static_cast<int>(c.layers.size());
  double best = 1e300;
  std::vector<int> cut(parts + 1, 0);
  cut[parts] = n;
  // Enumerate cut points 0 < cut[1] < ... < cut[parts-1] < n recursively.
  auto rec = [&](auto&& self, int t) -> void {
    if (t == parts) {
      double worst = 0;
      for (int k = 0; k < parts; ++k) {
        double v = 0;
        for (int i = cut[k]; i < cut[k + 1]; ++i) v += c.layers[i];
        if (k == 0) v += c.embedding;
        if (k == parts - 1) v += c.head;
        worst = std::max(worst, v);
      }
      best = std::min(best, worst);
      return;
    }
    for (int i = cut[t - 1] + 1; i <= n - (parts - t); ++i) {
      cut[t] = i;
      self(self, t + 1);
    }
  };
  rec(rec, 1);
  return best;
}

void check_shape(const partition& p, const layer_costs& c, int parts) {
  const int n = static_cast<int>(c.layers.size());
  REQUIRE(p.parts() == parts);
  REQUIRE(p.first.size() == static_cast<std::size_t>(parts + 1));
  CHECK(p.first.front() == 0);
  CHECK(p.first.back() == n);
  for (int k = 0; k < parts; ++k) {
    CHECK(p.layers(k) >= 1);
    double v = 0;
    for (int i = p.first[k]; i < p.first[k + 1]; ++i) v += c.layers[i];
    if (k == 0) v += c.embedding;
    if (k == parts - 1) v += c.head;
    CHECK(p.cost[k] == v);  // integer-valued costs: exact
  }
}

}  // namespace

TEST_CASE("balanced partitions are as good as the best split found by brute force") {
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> cost(0, 20), head(0, 60);
  for (int trial = 0; trial < 300; ++trial) {
    layer_costs c;
    const int n = 1 + trial % 11;
    for (int i = 0; i < n; ++i) c.layers.push_back(cost(rng));
    c.embedding = trial % 3 == 0 ? 0 : head(rng);
    c.head = trial % 4 == 0 ? 0 : head(rng);
    for (int parts = 1; parts <= n; ++parts) {
      INFO("trial " << trial << " layers " << n << " parts " << parts);
      auto p = balanced_partition(c, parts);
      check_shape(p, c, parts);
      CHECK(p.max_cost() == brute_force(c, parts));
      CHECK(p.max_cost() <= even_partition(c, parts).max_cost());
    }
  }
}

TEST_CASE("a heavy head and embedding leave fewer layers on the first and last stages") {
  // 24 equal layers on 4 stages; the embedding costs 2 layers and the head 4.
  layer_costs c{std::vector<double>(24, 1.0), 2.0, 4.0};
  auto even = even_partition(c, 4);
  CHECK(even.first == std::vector<int>{0, 6, 12, 18, 24});
  CHECK(even.cost == std::vector<double>{8, 6, 6, 10});
  auto p = balanced_partition(c, 4);
  CHECK(p.max_cost() == 8.0);  // (24 + 2 + 4) / 4 = 7.5, rounded up to whole layers
  CHECK(p.first == std::vector<int>{0, 6, 14, 22, 24});  // later parts as light as allowed
  CHECK(p.cost == std::vector<double>{8, 8, 8, 6});
}

TEST_CASE("even partitions give the first layers mod parts one more layer") {
  layer_costs c{std::vector<double>(10, 1.0), 0, 0};
  CHECK(even_partition(c, 4).first == std::vector<int>{0, 3, 6, 8, 10});
  CHECK(even_partition(c, 10).first == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10});
  CHECK(even_partition(c, 1).cost == std::vector<double>{10});
}

TEST_CASE("virtual stages map to parts chunk by chunk") {
  // Two stages with two chunks: parts 0 1 2 3 are stage 0 chunk 0, stage 1 chunk 0, stage 0
  // chunk 1, stage 1 chunk 1.
  CHECK(part_index(0, 0, 2) == 0);
  CHECK(part_index(1, 0, 2) == 1);
  CHECK(part_index(0, 1, 2) == 2);
  CHECK(part_index(1, 1, 2) == 3);
}

TEST_CASE("partitions reject impossible requests") {
  layer_costs c{{1, 2, 3}, 0, 0};
  CHECK_THROWS_WITH(balanced_partition(c, 4),
                    Catch::Contains("parts = 4 must be in [1, layers = 3]"));
  CHECK_THROWS_WITH(even_partition(c, 0), Catch::Contains("parts = 0"));
  c.layers[1] = -1;
  CHECK_THROWS_WITH(balanced_partition(c, 2), Catch::Contains("layer 1 is negative"));
  CHECK_THROWS_AS(balanced_partition(layer_costs{{1}, -1, 0}, 1), std::invalid_argument);
}

// The estimate against a hand count in double: GPT-2 small (C 768, 12 heads, V 50257, T 1024).
// Forward per token: q, k, v, o 4 C^2 and the MLP 8 C^2 weights, 2 flops each, plus 4 T C for the
// attention scores and their weighted sum; backward twice that.
TEST_CASE("the FLOP estimate counts blocks head and embedding per token") {
  model_shape m;
  m.layers = 12, m.heads = 12, m.kv_heads = 12, m.hidden = 768, m.vocab = 50257, m.seq = 1024;
  const double c = 768, t = 1024, v = 50257;
  auto costs = transformer_costs(m);
  REQUIRE(costs.layers.size() == 12u);
  CHECK(costs.layers[5] == Approx(3 * (2 * 12 * c * c + 4 * t * c)));
  CHECK(costs.head == Approx(3 * (2 * c * v + 5 * v)));
  CHECK(costs.embedding == Approx(3 * c));
  // A tensor shard does 1/tp of each; grouped kv heads and a gated MLP change the block.
  CHECK(transformer_costs(m, 4).layers[0] == Approx(costs.layers[0] / 4));
  m.kv_heads = 4, m.ffn = 2048, m.gated_mlp = true;
  const double kv = c * 4 / 12;
  CHECK(transformer_costs(m).layers[0] ==
        Approx(3 * (2 * (2 * c * c + 2 * c * kv + 3 * c * 2048) + 4 * t * c)));
  m.vocab = 0;
  CHECK_THROWS_WITH(transformer_costs(m), Catch::Contains("model_shape.vocab must be > 0"));
}

// GPT-2 small's head costs about 4.5 blocks: the balanced split gives the last stage fewer blocks
// and a smaller maximum than the even one; a small vocabulary (gpt2-demo) keeps the even split.
TEST_CASE("a balanced partition gives the stage with the head fewer layers") {
  model_shape m;
  m.layers = 12, m.heads = 12, m.kv_heads = 12, m.hidden = 768, m.vocab = 50257, m.seq = 1024;
  auto even = partition_layers(partition_kind::even, m, 2);
  auto bal = partition_layers(partition_kind::balanced, m, 2);
  CHECK(even.first == std::vector<int>{0, 6, 12});
  CHECK(bal.first == std::vector<int>{0, 8, 12});  // 8 blocks vs 4 blocks + a 4.5-block head
  CHECK(bal.max_cost() < 0.85 * even.max_cost());
  CHECK(bal.max_cost() == Approx(brute_force(transformer_costs(m), 2)));
  auto four = partition_layers(partition_kind::balanced, m, 4);
  CHECK(four.layers(3) < four.layers(0));
  CHECK(four.max_cost() == Approx(brute_force(transformer_costs(m), 4)));
  model_shape demo;
  demo.layers = 4, demo.heads = 4, demo.kv_heads = 4, demo.hidden = 128, demo.vocab = 256;
  demo.seq = 128;
  CHECK(partition_layers(partition_kind::balanced, demo, 2).first == std::vector<int>{0, 2, 4});
}
