// Smoke test of a tiny GPT held in bf16 and f16: forward and backward run on the CPU's 16-bit
// kernels, and the loss and gradients stay close to those of the f32 model with the same (rounded)
// weights.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "models/gpt.hpp"
#include "models/layers/testing.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

// The values of a tensor of any floating dtype, as doubles.
std::vector<double> values_of(const tensor& t) {
  auto host = empty(t.sizes(), dtype::f64);
  ops::copy(t, host);
  const double* p = host.data_as<double>();
  return std::vector<double>(p, p + t.numel());
}

}  // namespace

TEMPLATE_TEST_CASE_SIG("A tiny GPT in 16 bits tracks the f32 model with the same weights", "[cpu]",
                       ((dtype T), T), dtype::bf16, dtype::f16) {
  // Weights larger than GPT-2's init so that the logits are far from uniform.
  const gpt_config cfg{
      .vocab = 50, .max_seq = 32, .dim = 64, .n_layer = 2, .n_head = 4, .init_std = 0.2};
  const batch_dims dims{2, 32};
  gpt half(cfg, dims, T), full(cfg, dims, dtype::f32);
  half.init_weights(3);
  // The f32 model gets the 16-bit weights exactly (every 16-bit value is an f32).
  const auto& hs = half.slots().slots();
  const auto& fs = full.slots().slots();
  REQUIRE(hs.size() == fs.size());
  for (std::size_t i = 0; i < hs.size(); ++i)
    if (hs[i].kind == slot_kind::param) ops::copy(*hs[i].field, *fs[i].field);

  rng g(9);
  std::vector<std::int32_t> in(64), tg(64);
  for (auto& v : in) v = static_cast<std::int32_t>(g.integer(0, cfg.vocab - 1));
  for (std::size_t i = 0; i < in.size(); ++i)
    tg[i] = i % 32 == 31 ? -100 : in[i + 1];  // next-token targets, last position ignored
  const tensor ids(in.data(), 256, dtype::i32, {2, 32}),
      targets(tg.data(), 256, dtype::i32, {2, 32});

  half.memory().zero_grads();
  full.memory().zero_grads();
  const double loss_half = half.forward(ids, targets);
  const double loss_full = full.forward(ids, targets);
  INFO("loss " << dtype_name(T) << " " << loss_half << ", f32 " << loss_full);
  CHECK(std::fabs(loss_full - std::log(50.0)) > 0.1);  // not the uniform-logits loss
  CHECK(std::fabs(loss_half - loss_full) < 1e-2);
  half.backward();
  full.backward();

  // Every gradient is finite, and the whole gradient points the same way as f32's with about the
  // same length (16-bit activations and products perturb each element by ~1%).
  double dot = 0, nh = 0, nf = 0;
  for (std::size_t i = 0; i < hs.size(); ++i) {
    if (hs[i].kind != slot_kind::param) continue;
    REQUIRE(ops::all_finite(*hs[i].grad));
    const auto a = values_of(*hs[i].grad), b = values_of(*fs[i].grad);
    for (std::size_t j = 0; j < a.size(); ++j) {
      dot += a[j] * b[j];
      nh += a[j] * a[j];
      nf += b[j] * b[j];
    }
  }
  INFO("gradient norms " << std::sqrt(nh) << " and " << std::sqrt(nf));
  CHECK(nf > 0);
  CHECK(dot / std::sqrt(nh * nf) > 0.999);
  CHECK(std::fabs(std::sqrt(nh / nf) - 1) < 0.02);
}
