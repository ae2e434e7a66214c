// The reduction kernels against the scalar conversions of tensor/dtype.hpp, bit for bit.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "collective/reduce.hpp"

using namespace troupe;
using namespace troupe::collective;

namespace {

float bits_to_f32(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Floats that stress rounding: ties, near-ties, subnormals, overflow, infinities, NaN, plus noise.
std::vector<float> tricky_floats() {
  std::vector<float> v;
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) v.push_back(bits_to_f32(rng()));
  for (std::uint32_t base : {0x3f800000u, 0x47800000u, 0x38800000u, 0x33000000u, 0x00000001u,
                             0x7f7fffffu, 0x477ff000u, 0x477fefffu})
    for (std::uint32_t low = 0; low < 0x20000u; low += 0x0fffu)
      for (std::uint32_t sign : {0u, 0x80000000u}) v.push_back(bits_to_f32((base + low) | sign));
  v.push_back(std::numeric_limits<float>::infinity());
  v.push_back(-std::numeric_limits<float>::infinity());
  v.push_back(std::numeric_limits<float>::quiet_NaN());
  v.push_back(0.0f);
  v.push_back(-0.0f);
  return v;
}

}  // namespace

TEST_CASE("narrow rounds like the scalar bf16 and f16 conversions", "[collective][reduce]") {
  const auto src = tricky_floats();
  for (dtype h : {dtype::bf16, dtype::f16}) {
    std::vector<std::uint16_t> got(src.size());
    narrow(got.data(), src.data(), src.size(), h, 1.0f);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < src.size(); ++i) {
      std::uint16_t want = h == dtype::bf16 ? f32_to_bf16_bits(src[i]) : f32_to_f16_bits(src[i]);
      if (std::isnan(src[i])) {  // any NaN will do (F16C keeps more payload bits)
        float back = h == dtype::bf16 ? bf16_bits_to_f32(got[i]) : f16_bits_to_f32(got[i]);
        bad += !std::isnan(back);
      } else if (got[i] != want && bad++ < 5) {
        UNSCOPED_INFO(dtype_name(h) << " " << src[i] << ": got " << got[i] << " want " << want);
      }
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("widen is exact for every 16-bit pattern", "[collective][reduce]") {
  std::vector<std::uint16_t> all(65536);
  for (std::uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<std::uint16_t>(i);
  for (dtype h : {dtype::bf16, dtype::f16}) {
    std::vector<float> got(all.size());
    widen(got.data(), all.data(), all.size(), h);
    std::size_t bad = 0;
    for (std::size_t i = 0; i < all.size(); ++i) {
      float want = h == dtype::bf16 ? bf16_bits_to_f32(all[i]) : f16_bits_to_f32(all[i]);
      if (std::isnan(want))
        bad += !std::isnan(got[i]);
      else
        bad += std::memcmp(&got[i], &want, 4) != 0;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("reduce kernels match scalar sums maxima and divisions bit for bit",
          "[collective][reduce]") {
  std::mt19937 rng(3);
  std::uniform_real_distribution<float> dist(-100.0f, 100.0f);
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{8},
                        std::size_t{9}, std::size_t{1001}}) {
    std::vector<float> a(n), b(n), out(n);
    std::vector<double> ad(n), bd(n), outd(n);
    for (std::size_t i = 0; i < n; ++i) {
      a[i] = dist(rng);
      b[i] = dist(rng);
      ad[i] = static_cast<double>(a[i]) / 3;
      bd[i] = static_cast<double>(b[i]) / 7;
    }
    for (reduce_op op : {reduce_op::sum, reduce_op::max}) {
      reduce_same(out.data(), a.data(), b.data(), n, dtype::f32, op);
      reduce_same(outd.data(), ad.data(), bd.data(), n, dtype::f64, op);
      for (std::size_t i = 0; i < n; ++i) {
        CHECK(out[i] == (op == reduce_op::sum ? a[i] + b[i] : (a[i] > b[i] ? a[i] : b[i])));
        CHECK(outd[i] == (op == reduce_op::sum ? ad[i] + bd[i] : std::max(ad[i], bd[i])));
      }
      for (dtype h : {dtype::bf16, dtype::f16}) {
        std::vector<std::uint16_t> bh(n), rh(n);
        narrow(bh.data(), b.data(), n, h, 1.0f);
        std::vector<float> wide(n);
        reduce_widen(wide.data(), a.data(), bh.data(), n, h, op);
        reduce_narrow(rh.data(), a.data(), bh.data(), n, h, op, 3.0f);
        for (std::size_t i = 0; i < n; ++i) {
          float bw = h == dtype::bf16 ? bf16_bits_to_f32(bh[i]) : f16_bits_to_f32(bh[i]);
          float s = op == reduce_op::sum ? a[i] + bw : (a[i] > bw ? a[i] : bw);
          CHECK(wide[i] == s);
          CHECK(rh[i] ==
                (h == dtype::bf16 ? f32_to_bf16_bits(s / 3.0f) : f32_to_f16_bits(s / 3.0f)));
        }
      }
    }
    std::vector<float> q = a;
    divide(q.data(), n, dtype::f32, 3.0);
    for (std::size_t i = 0; i < n; ++i) CHECK(q[i] == a[i] / 3.0f);
  }
  CHECK_THROWS_WITH(check_reducible(dtype::i32, "allreduce on x"),
                    Catch::Contains("allreduce on x") && Catch::Contains("i32"));
}
