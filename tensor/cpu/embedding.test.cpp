// Tests of the CPU embedding lookup and its scatter-add backward.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "tensor/cpu/testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

TEMPLATE_TEST_CASE("embedding gathers rows and its backward adds them up", "[cpu]", float, double) {
  using T = TestType;
  rng g(41);
  const std::int64_t vocab = 50, cols = 300, b = 4, t = 257;  // many repeated ids
  buffer<T> table({vocab, cols}), out({b, t, cols}), dout({b, t, cols}), dtable({vocab, cols});
  fill_uniform(table, g, -1, 1);
  fill_uniform(dout, g, -1, 1);
  fill_uniform(dtable, g, -1, 1);
  buffer<std::int32_t> ids32({b, t});
  buffer<std::int64_t> ids64({b, t});
  for (std::int64_t i = 0; i < b * t; ++i)
    ids64[i] = ids32[i] = std::int32_t(g.integer(0, vocab - 1));
  ids64[0] = ids32[0] = vocab - 1;

  for (const tensor* ids : {&ids32.t, &ids64.t}) {
    ops::embedding(*ids, table, out);
    for (std::int64_t i = 0; i < b * t; ++i)
      for (std::int64_t c = 0; c < cols; ++c)
        REQUIRE(out[i * cols + c] == table[ids64[i] * cols + c]);
  }

  // Backward: dtable += scatter-add of dout rows, summed per id in double for the reference.
  std::vector<double> ref(vocab * cols), mag(vocab * cols);
  for (std::int64_t i = 0; i < vocab * cols; ++i) {
    ref[i] = dtable[i];
    mag[i] = std::fabs(ref[i]);
  }
  for (std::int64_t i = 0; i < b * t; ++i)
    for (std::int64_t c = 0; c < cols; ++c) {
      ref[ids64[i] * cols + c] += dout[i * cols + c];
      mag[ids64[i] * cols + c] += std::fabs(dout[i * cols + c]);
    }
  buffer<T> dtable2({vocab, cols});
  ops::copy(dtable, dtable2);
  ops::embedding_backward(ids32, dout, dtable);
  // Adds in T, one rounding per term: |error| <= (terms) * eps * (sum of magnitudes).
  const double k = double(b * t) * eps_of<T>;
  for (std::int64_t i = 0; i < vocab * cols; ++i) {
    INFO("element " << i);
    REQUIRE(std::fabs(double(dtable[i]) - ref[i]) <= k * mag[i]);
  }
  // i64 ids give the same sums in the same order.
  ops::embedding_backward(ids64, dout, dtable2);
  for (std::int64_t i = 0; i < vocab * cols; ++i) REQUIRE(dtable2[i] == dtable[i]);
}

TEST_CASE("embedding names an out of range id and its position", "[cpu]") {
  buffer<float> table({10, 4}), out({3, 4}), dtable({10, 4});
  buffer<std::int64_t> ids({3});
  ids[0] = 1;
  ids[1] = 10;
  ids[2] = 2;
  REQUIRE_THROWS_WITH(ops::embedding(ids, table, out),
                      Catch::Contains("id 10 at position 1 is outside the table's 10 rows"));
  ids[1] = -1;
  REQUIRE_THROWS_WITH(ops::embedding_backward(ids, out, dtable),
                      Catch::Contains("id -1 at position 1"));
  buffer<float> fids({3});
  REQUIRE_THROWS_WITH(ops::embedding(fids, table, out), Catch::Contains("ids must be i32 or i64"));
  buffer<float> wrong({3, 5});
  REQUIRE_THROWS_WITH(ops::embedding(ids, table, wrong), Catch::Contains("out must be [3, 4]"));
}
