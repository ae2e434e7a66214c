// Tests of the CPU rotary embedding: the tables against the closed form, the rotation against a
// double loop (strided views, in place, inverse).
#include <catch2/catch.hpp>

#include <cmath>
#include <vector>

#include "tensor/cpu/testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::cpu::testing;

TEMPLATE_TEST_CASE("rope tables follow the closed form", "[cpu]", float, double) {
  using T = TestType;
  for (auto [start, d, theta] : {std::tuple<std::int64_t, std::int64_t, double>{0, 64, 10000.0},
                                 {1000, 128, 500000.0},
                                 {3, 2, 10000.0}}) {
    const std::int64_t nt = 37, half = d / 2;
    buffer<T> cos({nt, half}), sin({nt, half});
    ops::rope_tables(start, theta, cos, sin);
    std::vector<double> cref(nt * half), sref(nt * half);
    double max_angle = 0;
    for (std::int64_t t = 0; t < nt; ++t)
      for (std::int64_t i = 0; i < half; ++i) {
        const double angle = double(start + t) * std::pow(theta, -2.0 * double(i) / double(d));
        cref[t * half + i] = std::cos(angle);
        sref[t * half + i] = std::sin(angle);
        max_angle = std::max(max_angle, angle);
      }
    // The angle is formed in T (as HF does in float32): inv_freq and the product each round, so
    // the angle is off by a few units of T's roundoff times its size.
    const double atol = 4 * eps_of<T> * (max_angle + 1);
    require_close(cos, cref, 0, atol);
    require_close(sin, sref, 0, atol);
  }
}

// HF's scaled inverse frequencies in double, from their definition (ops.hpp, transformers'
// modeling_rope_utils.py); band: 0 high (kept), 1 medium (smoothed), 2 low (divided by factor).
double scaled_inv_freq(std::int64_t i, std::int64_t d, const ops::rope_options& o, int* band) {
  using scaling = ops::rope_options::scaling;
  const double inv = std::pow(o.theta, -2.0 * double(i) / double(d));
  *band = 0;
  if (o.type == scaling::linear) return inv / o.factor;
  if (o.type == scaling::none) return inv;
  const double wavelen = 2 * M_PI / inv, ctx = o.original_max_position;
  if (wavelen < ctx / o.high_freq_factor) return inv;
  *band = 2;
  if (wavelen > ctx / o.low_freq_factor) return inv / o.factor;
  *band = 1;
  const double s = (ctx / wavelen - o.low_freq_factor) / (o.high_freq_factor - o.low_freq_factor);
  return (1 - s) * inv / o.factor + s * inv;
}

TEMPLATE_TEST_CASE("rope tables with linear and llama3 scaling follow HF's definitions", "[cpu]",
                   float, double) {
  using T = TestType;
  using scaling = ops::rope_options::scaling;
  const ops::rope_options linear{.theta = 10000.0, .type = scaling::linear, .factor = 4.0};
  // Llama 3.1's settings, where d = 128 has frequencies in all three bands, and a tiny model's.
  const ops::rope_options llama31{.theta = 500000.0,
                                  .type = scaling::llama3,
                                  .factor = 8.0,
                                  .low_freq_factor = 1.0,
                                  .high_freq_factor = 4.0,
                                  .original_max_position = 8192};
  const ops::rope_options tiny{.theta = 100.0,
                               .type = scaling::llama3,
                               .factor = 8.0,
                               .low_freq_factor = 1.0,
                               .high_freq_factor = 4.0,
                               .original_max_position = 32};
  for (auto [start, d, o] :
       {std::tuple<std::int64_t, std::int64_t, ops::rope_options>{0, 16, linear},
        {1000, 128, llama31},
        {0, 8, tiny},
        {5, 128, llama31}}) {
    INFO("start " << start << " d " << d << " theta " << o.theta);
    const std::int64_t nt = 37, half = d / 2;
    buffer<T> cos({nt, half}), sin({nt, half});
    ops::rope_tables(start, o, cos, sin);
    // The inverse frequency in T: theta^expo errs by |ln theta| expo u, pow, 1 / and the scaling
    // add a few u; the smoothing weight s = (L / w - low) / (high - low) errs by up to
    // 4 u high / (high - low), which moves the result (at least inv / factor) by that times
    // factor. The angle adds its product's rounding, cos and sin their own.
    const double u = eps_of<T>;
    const double rel =
        (std::log(o.theta) + 6 +
         4 * o.factor * o.high_freq_factor / (o.high_freq_factor - o.low_freq_factor)) *
        u;
    int bands[3] = {0, 0, 0};
    for (std::int64_t i = 0; i < half; ++i) {
      int band = 0;
      const double inv = scaled_inv_freq(i, d, o, &band);
      ++bands[band];
      for (std::int64_t t = 0; t < nt; ++t) {
        const double angle = double(start + t) * inv;
        const double bound = angle * (rel + u) + 2 * u;
        const std::int64_t k = t * half + i;
        INFO("position " << start + t << " pair " << i << " band " << band);
        REQUIRE(std::abs(double(cos[k]) - std::cos(angle)) <= bound);
        REQUIRE(std::abs(double(sin[k]) - std::sin(angle)) <= bound);
      }
    }
    if (o.type == scaling::llama3) {  // the case exercises every band
      CHECK(bands[0] > 0);
      CHECK(bands[1] > 0);
      CHECK(bands[2] > 0);
    }
  }
}

TEST_CASE("rope tables refuse scaling options out of range", "[cpu]") {
  using scaling = ops::rope_options::scaling;
  buffer<float> cos({4, 3}), sin({4, 3});
  REQUIRE_THROWS_WITH(
      ops::rope_tables(0, {.theta = 1e4, .type = scaling::linear, .factor = 0.0}, cos, sin),
      Catch::Contains("factor must be > 0"));
  REQUIRE_THROWS_WITH(ops::rope_tables(0,
                                       {.theta = 1e4,
                                        .type = scaling::llama3,
                                        .factor = 8.0,
                                        .low_freq_factor = 4.0,
                                        .high_freq_factor = 4.0},
                                       cos, sin),
                      Catch::Contains("low_freq_factor < high_freq_factor"));
}

TEMPLATE_TEST_CASE("rope rotates strided views in place and inverts", "[cpu]", float, double) {
  using T = TestType;
  rng g(31);
  const std::int64_t nb = 2, nt = 13, nh = 3;
  for (std::int64_t d : {2, 8, 128}) {
    const std::int64_t half = d / 2;
    buffer<T> cos({20, half}), sin({20, half});  // more positions than T
    ops::rope_tables(5, 10000.0, cos, sin);
    // x is the q part of a fused [B, T, 3, H, D] qkv buffer: strided in B, T and H.
    buffer<T> qkv({nb, nt, 3, nh, d});
    fill_uniform(qkv, g, -2, 2);
    const tensor x = qkv.t.select(2, 0);
    REQUIRE(!x.is_contiguous());
    buffer<T> y({nb, nt, nh, d}), back({nb, nt, nh, d});

    std::vector<double> ref(y.size()), iref(y.size());
    auto xv = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t i) {
      return double(qkv[(((b * nt + t) * 3 + 0) * nh + h) * d + i]);
    };
    for (std::int64_t b = 0; b < nb; ++b)
      for (std::int64_t t = 0; t < nt; ++t)
        for (std::int64_t h = 0; h < nh; ++h)
          for (std::int64_t i = 0; i < half; ++i) {
            const double c = cos[t * half + i], s = sin[t * half + i];
            const double x1 = xv(b, t, h, i), x2 = xv(b, t, h, i + half);
            const std::int64_t o = ((b * nt + t) * nh + h) * d + i;
            ref[o] = x1 * c - x2 * s;
            ref[o + half] = x2 * c + x1 * s;
            iref[o] = x1 * c + x2 * s;
            iref[o + half] = x2 * c - x1 * s;
          }

    // |x1| + |x2| <= 4: two products and a sum, each rounded in T.
    ops::rope(x, cos, sin, y);
    require_close(y, ref, 0, 4 * eps_of<T> * 4);
    ops::rope(x, cos, sin, back, /*inverse=*/true);
    require_close(back, iref, 0, 4 * eps_of<T> * 4);

    // The inverse undoes the forward (cos^2 + sin^2 = 1 up to the tables' rounding).
    ops::rope(y, cos, sin, back, true);
    std::vector<double> orig(y.size());
    for (std::int64_t i = 0; i < y.size(); ++i)
      orig[i] = xv(i / (nt * nh * d), (i / (nh * d)) % nt, (i / d) % nh, i % d);
    require_close(back, orig, 0, 16 * eps_of<T> * 4);

    // In place on the strided view: the same values as out of place.
    ops::rope(x, cos, sin, x);
    buffer<T> packed({nb, nt, nh, d});
    ops::copy(x, packed);
    require_close(packed, ref, 0, 4 * eps_of<T> * 4);
  }
}

TEST_CASE("rope rejects bad shapes", "[cpu]") {
  buffer<float> x({1, 4, 2, 6}), y({1, 4, 2, 6}), cos({4, 3}), sin({4, 3}), short_cos({3, 3});
  buffer<float> odd({1, 4, 2, 5});
  REQUIRE_THROWS_WITH(ops::rope(odd, cos, sin, odd),
                      Catch::Contains("head dimension must be even"));
  REQUIRE_THROWS_WITH(ops::rope(x, short_cos, sin, y), Catch::Contains("cos must be [T >= 4, 3]"));
  REQUIRE_THROWS_WITH(ops::rope(x.t.transpose(2, 3), cos, sin, y.t.transpose(2, 3)),
                      Catch::Contains("contiguous last dimension"));
  buffer<double> cd({4, 3});
  REQUIRE_THROWS_WITH(ops::rope(x, cd, sin, y), Catch::Contains("rope: cos has dtype f64"));
}
