// attention_merge against attention over the union of the key blocks: merging the attention over
// keys [0, S1) with the attention over [S1, S) gives the attention over [0, S), as accurate as the
// single call (tests/rounding.hpp), also into strided views of a longer sequence.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <limits>
#include <vector>

#include "memory/error.hpp"
#include "tensor/attention_merge.hpp"
#include "tensor/cpu/testing.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

namespace troupe {
namespace {

struct run {
  owned_tensor q, k, v, out, lse, out_a, lse_a, out_b, lse_b;
};

// One run in `type`: the whole attention (out, lse), the one over the first s1 keys (out_a,
// lse_a) merged with the one over the rest (out_b, lse_b) into out_a, lse_a.
run make(dtype type, std::int64_t b, std::int64_t t, std::int64_t s, std::int64_t s1,
         std::int64_t hq, std::int64_t hkv, std::int64_t d, std::uint64_t seed) {
  run r;
  r.q = empty({b, t, hq, d}, type);
  r.k = empty({b, s, hkv, d}, type);
  r.v = empty({b, s, hkv, d}, type);
  cpu::testing::rng g(seed);
  double scale = 3.0;  // q scaled up: softmax rows far from uniform
  for (const tensor* x : {&r.q, &r.k, &r.v}) {
    for (std::int64_t i = 0; i < x->numel(); ++i) {
      const float f = static_cast<float>(g.uniform(-scale, scale));
      if (type == dtype::f64)
        x->data_as<double>()[i] = f;
      else
        x->data_as<float>()[i] = f;
    }
    scale = 1.0;
  }
  for (auto* o : {&r.out, &r.out_a, &r.out_b}) *o = empty({b, t, hq, d}, type);
  for (auto* l : {&r.lse, &r.lse_a, &r.lse_b}) *l = empty({b, hq, t}, type);
  const ops::attention_options full{0.0, false, {}};
  ops::attention(r.q, r.k, r.v, r.out, r.lse, full);
  ops::attention(r.q, r.k.narrow(1, 0, s1), r.v.narrow(1, 0, s1), r.out_a, r.lse_a, full);
  ops::attention(r.q, r.k.narrow(1, s1, s - s1), r.v.narrow(1, s1, s - s1), r.out_b, r.lse_b, full);
  ops::attention_merge(r.out_a, r.lse_a, r.out_b, r.lse_b);
  return r;
}

template <class T>
std::vector<double> vals(const tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = t.data_as<T>()[i];
  return v;
}

}  // namespace

TEST_CASE("merging the attention over two key blocks gives the attention over both",
          "[tensor][attention]") {
  const std::int64_t hkv = GENERATE(4, 1);
  INFO(hkv << " kv heads of 4");
  const run f = make(dtype::f32, 2, 40, 150, 70, 4, hkv, 16, 5);
  const run x = make(dtype::f64, 2, 40, 150, 70, 4, hkv, 16, 5);
  // The merged result adds the two blocks' sums in another order than the single call (one
  // rescale and one addition per element more): as accurate as it, within default_k.
  const auto o =
      tests::as_accurate_as(vals<float>(f.out_a), vals<float>(f.out), vals<double>(x.out));
  INFO("out: " << o.str());
  CHECK(o.ok());
  const auto l =
      tests::as_accurate_as(vals<float>(f.lse_a), vals<float>(f.lse), vals<double>(x.lse));
  INFO("lse: " << l.str());
  CHECK(l.ok());
  // A merge that dropped a block would be off by O(|out|): far outside the bound.
  const auto dropped =
      tests::as_accurate_as(vals<float>(f.out_b), vals<float>(f.out), vals<double>(x.out));
  CHECK_FALSE(dropped.ok());
}

TEST_CASE("attention_merge writes into strided views and takes a block of no keys as nothing",
          "[tensor][attention]") {
  // out and lse of a longer sequence [B, 2T, ...]: merging into its second half leaves the first.
  const run f = make(dtype::f64, 1, 8, 20, 9, 2, 2, 4, 9);
  auto out = empty({1, 16, 2, 4}, dtype::f64), lse = empty({1, 2, 16}, dtype::f64);
  const double inf = std::numeric_limits<double>::infinity();
  for (std::int64_t i = 0; i < 128; ++i) out.data_as<double>()[i] = i < 64 ? 7.0 : 0.0;
  for (std::int64_t i = 0; i < 32; ++i) lse.data_as<double>()[i] = i % 16 < 8 ? 7.0 : -inf;
  ops::attention_merge(out.narrow(1, 8, 8), lse.narrow(2, 8, 8), f.out, f.lse);
  for (std::int64_t i = 0; i < 64; ++i) CHECK(out.data_as<double>()[i] == 7.0);
  for (std::int64_t i = 0; i < 64; ++i)
    CHECK(out.data_as<double>()[64 + i] == f.out.data_as<double>()[i]);
  for (std::int64_t h = 0; h < 2; ++h)
    for (std::int64_t t = 0; t < 8; ++t) {
      CHECK(lse.data_as<double>()[h * 16 + t] == 7.0);
      CHECK(lse.data_as<double>()[h * 16 + 8 + t] == f.lse.data_as<double>()[h * 8 + t]);
    }
  // A part of -inf (no key) leaves the running result as it was.
  auto none = empty({1, 2, 8}, dtype::f64);
  ops::fill(none, -inf);
  ops::attention_merge(f.out_a, f.lse_a, f.out_b, none);
  const run again = make(dtype::f64, 1, 8, 20, 9, 2, 2, 4, 9);
  CHECK(vals<double>(f.out_a) == vals<double>(again.out_a));
}

TEST_CASE("attention_merge refuses mismatched shapes naming them", "[tensor][attention][faults]") {
  auto out = empty({1, 4, 2, 8}), lse = empty({1, 2, 4}), part = empty({1, 4, 2, 8}),
       bad_lse = empty({1, 4, 2});
  try {
    ops::attention_merge(out, lse, part, bad_lse);
    FAIL("accepted an lse of [1, 4, 2]");
  } catch (const troupe::error& e) {
    std::printf("faults: attention_merge with part_lse [1, 4, 2] -> refused: %s\n", e.what());
    CHECK_THAT(e.what(), Catch::Contains("lse and part_lse must be [1, 2, 4]"));
  }
}

}  // namespace troupe
