// vocab_parallel_entropy against the entropy of the whole rows: ranks are threads of a local
// group (collective/local), each holding its columns of the same f32 logits. The reference is
// written from the definition, H = -sum_k p_k log p_k with p = softmax(z), in f64 over the whole
// row; the function under test uses the shifted form M + log S - (sum e z) / S reduced over the
// shards. Both work in f64 from the same f32 inputs, so they differ only by f64 rounding: each row
// sums 12 terms of size <= ~10 (|z| <= 8 plus log 12), so 1e-12 absolute is a bound with room
// (the f64 rounding is ~1e-14 here). A missing max or sum reduction, or a shard's columns taken
// twice, is off by order 0.1 to 1.
#include <catch2/catch.hpp>

#include <cmath>
#include <exception>
#include <random>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/parallel/vocab_entropy.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;

TEST_CASE("The entropy of vocab-parallel logits is the entropy of the whole rows", "[parallel]") {
  const std::int64_t n = 5, v = 12;
  std::mt19937 g(7);
  std::uniform_real_distribution<float> u(-8.0f, 8.0f);
  std::vector<float> z(static_cast<std::size_t>(n * v));
  for (auto& x : z) x = u(g);
  // Row 1 nearly one-hot (entropy near 0), row 2 uniform (entropy log v).
  for (std::int64_t k = 0; k < v; ++k) z[static_cast<std::size_t>(v + k)] = k == 3 ? 30.0f : 0.0f;
  for (std::int64_t k = 0; k < v; ++k) z[static_cast<std::size_t>(2 * v + k)] = 1.5f;
  std::vector<double> want(static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < n; ++r) {
    double top = -1e300, s = 0, h = 0;
    for (std::int64_t k = 0; k < v; ++k) top = std::max(top, double(z[r * v + k]));
    for (std::int64_t k = 0; k < v; ++k) s += std::exp(double(z[r * v + k]) - top);
    for (std::int64_t k = 0; k < v; ++k) {
      const double p = std::exp(double(z[r * v + k]) - top) / s;
      if (p > 0) h -= p * std::log(p);
    }
    want[r] = h;
  }
  CHECK(want[2] == Approx(std::log(double(v))).margin(1e-12));
  for (int tp : {1, 2, 3, 4}) {
    INFO("tp " << tp);
    const std::int64_t local = v / tp;
    auto comms = collective::make_local_group(tp);
    std::vector<std::vector<double>> got(static_cast<std::size_t>(tp));
    std::vector<std::exception_ptr> err(static_cast<std::size_t>(tp));
    std::vector<std::thread> threads;
    for (int r = 0; r < tp; ++r)
      threads.emplace_back([&, r] {
        try {
          owned_tensor mine = empty({n, local}, dtype::f32);
          for (std::int64_t i = 0; i < n; ++i)
            for (std::int64_t k = 0; k < local; ++k)
              mine.data_as<float>()[i * local + k] = z[i * v + r * local + k];
          got[r] = vocab_parallel_entropy(mine, tp_group{comms[r].get(), false});
        } catch (...) {
          err[r] = std::current_exception();
          for (auto& c : comms) c->abort("rank " + std::to_string(r) + " failed");
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : err)
      if (e) std::rethrow_exception(e);
    for (int r = 0; r < tp; ++r)
      for (std::int64_t i = 0; i < n; ++i) {
        INFO("shard " << r << " row " << i);
        CHECK(std::abs(got[r][i] - want[i]) <= 1e-12);
      }
  }
}
