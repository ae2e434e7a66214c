#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "memory/error.hpp"
#include "tensor/parallel.hpp"
#include "tensor/tensor.hpp"

using namespace troupe;

TEST_CASE("a contiguous tensor describes its bytes") {
  std::vector<float> buf(24);
  tensor t(buf.data(), buf.size() * 4, dtype::f32, {2, 3, 4});
  REQUIRE(t.dim() == 3);
  REQUIRE(t.numel() == 24);
  REQUIRE(t.stride(0) == 12);
  REQUIRE(t.stride(-1) == 1);
  REQUIRE(t.is_contiguous());
  REQUIRE(t.data_as<float>() == buf.data());
  REQUIRE_THROWS_WITH(t.data_as<double>(), Catch::Contains("expected dtype f64"));
}

TEST_CASE("views share bytes and never copy") {
  std::vector<float> buf(24);
  for (int i = 0; i < 24; ++i) buf[i] = static_cast<float>(i);
  tensor t(buf.data(), buf.size() * 4, dtype::f32, {4, 6});
  auto s = t.slice(1, 2, 6, 2);  // columns 2 and 4
  REQUIRE(s.size(1) == 2);
  REQUIRE(!s.is_contiguous());
  REQUIRE(s.data_as<float>()[0] == 2.0f);
  REQUIRE(s.data_as<float>()[s.stride(0) * 3 + s.stride(1)] == 22.0f);
  auto tr = t.transpose(0, 1);
  REQUIRE(tr.size(0) == 6);
  REQUIRE(tr.stride(0) == 1);
  auto row = t.select(0, 2);
  REQUIRE(row.dim() == 1);
  REQUIRE(row.data_as<float>()[0] == 12.0f);
  auto n = t.narrow(0, 1, 2);
  REQUIRE(n.is_contiguous());
  REQUIRE(n.data_as<float>()[0] == 6.0f);
  auto r = t.reshape({2, -1, 3});
  REQUIRE(r.size(1) == 4);
  REQUIRE(r.data() == t.data());
  REQUIRE(t.unsqueeze(0).sizes() == shape{1, 4, 6});
  REQUIRE(t.unsqueeze(2).sizes() == shape{4, 6, 1});
}

TEST_CASE("bad views are clear errors") {
  std::vector<float> buf(24);
  tensor t(buf.data(), buf.size() * 4, dtype::f32, {4, 6});
  REQUIRE_THROWS_WITH(t.slice(1, 3, 8), Catch::Contains("out of bounds"));
  REQUIRE_THROWS_WITH(t.reshape({5, 5}), Catch::Contains("25 elements"));
  REQUIRE_THROWS_WITH(t.transpose(0, 1).reshape({24}), Catch::Contains("contiguous"));
  REQUIRE_THROWS_WITH(t.select(2, 0), Catch::Contains("dimension 2 out of range"));
  REQUIRE_THROWS_WITH(tensor(buf.data(), 40, dtype::f32, {4, 6}),
                      Catch::Contains("beyond its buffer"));
  REQUIRE_THROWS_WITH(tensor::strided(buf.data(), 96, dtype::f32, {4, 6}, {7, 1}, 0),
                      Catch::Contains("beyond its buffer"));
}

TEST_CASE("owned tensors keep their storage across moves") {
  auto a = empty({3, 5}, dtype::f64);
  void* p = a.data();
  owned_tensor b = std::move(a);
  REQUIRE(b.data() == p);
  REQUIRE(b.type() == dtype::f64);
  REQUIRE(b.nbytes() == 15 * 8);
}

TEST_CASE("conversions to and from bf16 and f16 round to nearest even") {
  REQUIRE(bf16_bits_to_f32(f32_to_bf16_bits(1.0f)) == 1.0f);
  // 1 + 2^-8 is halfway between two bf16 values: ties to even (1.0).
  REQUIRE(bf16_bits_to_f32(f32_to_bf16_bits(1.0f + 1.0f / 256)) == 1.0f);
  REQUIRE(bf16_bits_to_f32(f32_to_bf16_bits(1.0f + 3.0f / 256)) == 1.0f + 4.0f / 256);
  // Exact values: a conversion rounds once, the same on every CPU.
  REQUIRE(f16_bits_to_f32(f32_to_f16_bits(0.1f)) == 0.0999755859375f);  // 1638 / 2^14
  REQUIRE(f16_bits_to_f32(f32_to_f16_bits(65504.0f)) == 65504.0f);
  REQUIRE(std::isinf(f16_bits_to_f32(f32_to_f16_bits(70000.0f))));
  REQUIRE(f16_bits_to_f32(f32_to_f16_bits(6e-8f)) == 0x1p-24f);  // the smallest subnormal
  float nan = std::numeric_limits<float>::quiet_NaN();
  REQUIRE(std::isnan(f16_bits_to_f32(f32_to_f16_bits(nan))));
  REQUIRE(std::isnan(bf16_bits_to_f32(f32_to_bf16_bits(nan))));
}

TEST_CASE("parallel_for covers the range exactly once") {
  std::vector<int> hits(10007, 0);
  parallel::parallel_for(0, 10007, 16, [&](std::int64_t a, std::int64_t b) {
    for (auto i = a; i < b; ++i) hits[i] += 1;
  });
  for (int h : hits) REQUIRE(h == 1);
  // Nested calls run serially instead of deadlocking.
  std::vector<int> nested(64, 0);
  parallel::parallel_for(0, 8, 1, [&](std::int64_t a, std::int64_t b) {
    for (auto i = a; i < b; ++i)
      parallel::parallel_for(0, 8, 1, [&](std::int64_t c, std::int64_t d) {
        for (auto j = c; j < d; ++j) nested[i * 8 + j] += 1;
      });
  });
  for (int h : nested) REQUIRE(h == 1);
}
