// Tests of the bf16 and f16 paths of the CPU row ops (softmax, LayerNorm, RMSNorm, cross-entropy),
// rope and embedding: each against the f32 op run on the same rounded inputs, with saved
// statistics in the 16-bit dtype and in f32 (half_testing.hpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tensor/cpu/half_testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

namespace {

struct dims {
  std::int64_t rows, cols;
};
// Rows shorter than a vector, around the 256-column tiles, and a vocabulary-sized one.
const dims row_shapes[] = {{7, 1}, {5, 7}, {64, 300}, {10, 768}, {3, 50257}};

// The values of a statistics buffer in dtype St (the 16-bit type or f32), as f32 for the
// reference.
template <class St>
void copy_values(const buffer<St>& from, buffer<float>& to) {
  for (std::int64_t i = 0; i < from.size(); ++i) to[i] = static_cast<float>(value_of(from[i]));
}

}  // namespace

TEMPLATE_TEST_CASE("16-bit softmax and its backward round the f32 results once", "[cpu]", bf16_t,
                   f16_t) {
  using S = TestType;
  rng g(11);
  for (auto [rows, cols] : row_shapes) {
    twin<S> x({rows, cols}), dy({rows, cols});
    x.uniform(g, -10, 10);
    dy.uniform(g, -1, 1);
    buffer<S> y({rows, cols}), dx({rows, cols});
    buffer<float> ry({rows, cols}), rdx({rows, cols});
    ops::softmax(x.h, y);
    ops::softmax(x.f, ry);
    require_ulps(y, ry, 0.5);
    twin<S> yt({rows, cols});  // backward from the 16-bit forward's output
    for (std::int64_t i = 0; i < y.size(); ++i) yt.set(i, value_of(y[i]));
    ops::softmax_backward(yt.h, dy.h, dx);
    ops::softmax_backward(yt.f, dy.f, rdx);
    require_ulps(dx, rdx, 0.5);
  }
}

TEMPLATE_TEST_CASE("16-bit layernorm and its backward match f32 with either statistics dtype",
                   "[cpu]", bf16_t, f16_t) {
  using S = TestType;
  rng g(12);
  for (auto [rows, cols] : row_shapes) {
    INFO("rows " << rows << " cols " << cols);
    twin<S> x({rows, cols}), w({cols}), b({cols}), dy({rows, cols}), dw({cols}), db({cols});
    x.uniform(g, -3, 5);  // a mean away from 0
    w.uniform(g, 0.5, 1.5);
    b.uniform(g, -1, 1);
    dy.uniform(g, -1, 1);
    buffer<float> ry({rows, cols}), rm({rows}), rr({rows});
    ops::layernorm(x.f, w.f, b.f, ry, rm, rr, 1e-5);
    auto check = [&]<class St>(St) {
      INFO("statistics in " << dtype_name(dtype_of<St>));
      buffer<S> y({rows, cols}), dx({rows, cols});
      buffer<St> mean({rows}), rstd({rows});
      ops::layernorm(x.h, w.h, b.h, y, mean, rstd, 1e-5);
      require_ulps(y, ry, 0.5);
      if constexpr (std::is_same_v<St, float>) {
        require_close(mean, std::vector<double>(rm.v.begin(), rm.v.end()), 0, 0);
        require_close(rstd, std::vector<double>(rr.v.begin(), rr.v.end()), 0, 0);
      } else {
        require_ulps(mean, rm, 0.5);
        require_ulps(rstd, rr, 0.5);
      }
      // Backward from the saved statistics as stored; dw and db accumulate onto old values.
      dw.uniform(g, -1, 1);
      db.uniform(g, -1, 1);
      buffer<float> fm({rows}), fr({rows}), rdx({rows, cols});
      copy_values(mean, fm);
      copy_values(rstd, fr);
      ops::layernorm_backward(dy.h, x.h, w.h, mean, rstd, dx, dw.h, db.h);
      ops::layernorm_backward(dy.f, x.f, w.f, fm, fr, rdx, dw.f, db.f);
      require_ulps(dx, rdx, 0.5);
      require_ulps(dw.h, dw.f, 0.5);
      require_ulps(db.h, db.f, 0.5);
      // dx over dy (aliasing) gives the same bits.
      buffer<S> g2({rows, cols});
      std::copy(dy.h.v.begin(), dy.h.v.end(), g2.v.begin());
      ops::layernorm_backward(g2, x.h, w.h, mean, rstd, g2, dw.h, tensor());
      require_same_bits(g2, dx);
    };
    check(S{});
    check(float{});
  }
}

TEMPLATE_TEST_CASE("16-bit rmsnorm and its backward match f32 with either statistics dtype",
                   "[cpu]", bf16_t, f16_t) {
  using S = TestType;
  rng g(13);
  for (auto [rows, cols] : row_shapes) {
    INFO("rows " << rows << " cols " << cols);
    twin<S> x({rows, cols}), w({cols}), dy({rows, cols}), dw({cols});
    x.uniform(g, -3, 3);
    w.uniform(g, 0.5, 1.5);
    dy.uniform(g, -1, 1);
    buffer<float> ry({rows, cols}), rr({rows});
    ops::rmsnorm(x.f, w.f, ry, rr, 1e-6);
    auto check = [&]<class St>(St) {
      INFO("statistics in " << dtype_name(dtype_of<St>));
      buffer<S> y({rows, cols}), dx({rows, cols});
      buffer<St> rstd({rows});
      ops::rmsnorm(x.h, w.h, y, rstd, 1e-6);
      require_ulps(y, ry, 0.5);
      if constexpr (std::is_same_v<St, float>) {
        require_close(rstd, std::vector<double>(rr.v.begin(), rr.v.end()), 0, 0);
      } else {
        require_ulps(rstd, rr, 0.5);
      }
      dw.uniform(g, -1, 1);
      buffer<float> fr({rows}), rdx({rows, cols});
      copy_values(rstd, fr);
      ops::rmsnorm_backward(dy.h, x.h, w.h, rstd, dx, dw.h);
      ops::rmsnorm_backward(dy.f, x.f, w.f, fr, rdx, dw.f);
      require_ulps(dx, rdx, 0.5);
      require_ulps(dw.h, dw.f, 0.5);
    };
    check(S{});
    check(float{});
  }
}

TEMPLATE_TEST_CASE("16-bit cross_entropy matches f32 losses and gradients", "[cpu]", bf16_t,
                   f16_t) {
  using S = TestType;
  rng g(14);
  for (auto [rows, cols] : row_shapes) {
    twin<S> logits({rows, cols});
    logits.uniform(g, -8, 8);
    std::vector<std::int64_t> tv(static_cast<std::size_t>(rows));
    for (auto& t : tv) t = g.integer(0, cols - 1);
    if (rows > 2) tv[1] = -100;  // an ignored row
    const tensor targets(tv.data(), tv.size() * 8, dtype::i64, {rows});
    buffer<float> rl({rows}), rd({rows, cols});
    const double scale = 1.0 / static_cast<double>(rows);
    const std::int64_t counted = ops::cross_entropy(logits.f, targets, rl, rd, scale);
    auto check = [&]<class St>(St) {
      INFO("losses in " << dtype_name(dtype_of<St>));
      buffer<St> losses({rows});
      buffer<S> d({rows, cols});
      REQUIRE(ops::cross_entropy(logits.h, targets, losses, d, scale) == counted);
      if constexpr (std::is_same_v<St, float>) {
        require_close(losses, std::vector<double>(rl.v.begin(), rl.v.end()), 0, 0);
      } else {
        require_ulps(losses, rl, 0.5);
      }
      require_ulps(d, rd, 0.5);
      // Without a gradient, and with dlogits over the logits.
      buffer<St> l2({rows});
      ops::cross_entropy(logits.h, targets, l2, tensor(), scale);
      for (std::int64_t i = 0; i < rows; ++i) REQUIRE(value_of(l2[i]) == value_of(losses[i]));
      buffer<S> in_place({rows, cols});
      std::copy(logits.h.v.begin(), logits.h.v.end(), in_place.v.begin());
      ops::cross_entropy(in_place, targets, l2, in_place, scale);
      require_same_bits(in_place, d);
    };
    check(S{});
    check(float{});
  }
}

TEMPLATE_TEST_CASE("16-bit rope tables are the f32 tables rounded and rope rotates in f32", "[cpu]",
                   bf16_t, f16_t) {
  using S = TestType;
  const std::int64_t B = 2, T = 9, H = 3, D = 20, start = 5;
  buffer<S> cs({T, D / 2}), sn({T, D / 2});
  buffer<float> rc({T, D / 2}), rs({T, D / 2});
  ops::rope_tables(start, 10000.0, cs, sn);
  ops::rope_tables(start, 10000.0, rc, rs);
  for (std::int64_t i = 0; i < cs.size(); ++i) {
    REQUIRE(cs[i].bits == round_to<S>(rc[i]).bits);
    REQUIRE(sn[i].bits == round_to<S>(rs[i]).bits);
  }
  twin<S> c({T, D / 2}), s({T, D / 2});
  for (std::int64_t i = 0; i < c.size(); ++i) {
    c.set(i, value_of(cs[i]));
    s.set(i, value_of(sn[i]));
  }
  rng g(15);
  // x as a view with gaps between heads (a slice of a wider buffer), as in a fused qkv buffer.
  twin<S> wide({B, T, H, 2 * D});
  wide.uniform(g, -2, 2);
  const tensor xh = wide.h.t.narrow(3, D / 2, D), xf = wide.f.t.narrow(3, D / 2, D);
  for (bool inverse : {false, true}) {
    buffer<S> y({B, T, H, D});
    buffer<float> ry({B, T, H, D});
    ops::rope(xh, c.h, s.h, y, inverse);
    ops::rope(xf, c.f, s.f, ry, inverse);
    require_ulps(y, ry, 0.5);
    buffer<S> in_place({B, T, H, D});  // y over x
    ops::copy(xh, in_place);
    ops::rope(in_place, c.h, s.h, in_place, inverse);
    require_same_bits(in_place, y);
  }
}

TEMPLATE_TEST_CASE("16-bit embedding copies rows and its backward rounds every addition", "[cpu]",
                   bf16_t, f16_t) {
  using S = TestType;
  rng g(16);
  const std::int64_t V = 17, C = 300, N = 40;  // repeated ids, columns over one tile
  twin<S> table({V, C}), dout({N, C});
  table.uniform(g, -1, 1);
  dout.uniform(g, -1, 1);
  std::vector<std::int32_t> iv(N);
  for (auto& i : iv) i = static_cast<std::int32_t>(g.integer(0, V - 1));
  const tensor ids(iv.data(), iv.size() * 4, dtype::i32, {N});
  buffer<S> out({N, C});
  ops::embedding(ids, table.h, out);
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t j = 0; j < C; ++j)
      REQUIRE(out[n * C + j].bits == table.h[iv[n] * C + j].bits);
  // dtable += rows of dout in id order: each sum formed in f32 and rounded, as in a plain loop.
  buffer<S> want({V, C});
  std::copy(table.h.v.begin(), table.h.v.end(), want.v.begin());
  for (std::int64_t n = 0; n < N; ++n)
    for (std::int64_t j = 0; j < C; ++j) {
      S& t = want[iv[n] * C + j];
      t = round_to<S>(static_cast<float>(value_of(t)) +
                      static_cast<float>(value_of(dout.h[n * C + j])));
    }
  ops::embedding_backward(ids, dout.h, table.h);
  require_same_bits(table.h, want);
}
