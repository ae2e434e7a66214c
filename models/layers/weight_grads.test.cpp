// Tests of deferred_weight_grads (weight_grads.hpp): an MLP's backward split into dx now and the
// weight gradients later gives the gradients of the plain backward bit for bit, even when later
// microbatches overwrite the scratch and the input in between.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "models/layers/mlp.hpp"
#include "models/layers/testing.hpp"
#include "models/layers/weight_grads.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

bool same_bits(const tensor& a, const tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data(), b.data(), a.nbytes()) == 0;
}

}  // namespace

TEST_CASE("Deferred weight gradients equal the plain backward bit for bit", "[cpu]") {
  for (bool bias : {true, false}) {
    INFO("bias " << bias);
    rng g(77);
    mlp ff({.dim = 4, .hidden = 12, .bias = bias});
    slot_list s;
    ff.declare(s, "mlp", {2, 3});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    std::vector<owned_tensor> xs, rs;
    for (int k = 0; k < 3; ++k) {
      xs.push_back(random_tensor({2, 3, 4}, g, 2.0));
      rs.push_back(random_tensor({2, 3, 4}, g));
    }
    auto x = empty({2, 3, 4}, dtype::f64);  // one input buffer, overwritten by each microbatch
    auto y = empty({2, 3, 4}, dtype::f64);
    auto dx = empty({2, 3, 4}, dtype::f64);

    // Plain: forward and backward of each microbatch in turn.
    mem.zero_grads();
    std::vector<std::vector<double>> plain_dx;
    for (int k = 0; k < 3; ++k) {
      std::memcpy(x.data(), xs[k].data(), x.nbytes());
      ff.forward(x, y);
      ff.backward(rs[k], dx);
      plain_dx.push_back(values(dx));
    }
    auto plain = empty(mem.grads().sizes(), mem.grads().type());
    std::memcpy(plain.data(), mem.grads().data(), plain.nbytes());

    // Split: every backward queues its weight gradients; they run after all three backwards.
    mem.zero_grads();
    std::vector<deferred_weight_grads> q(3);
    std::vector<std::int64_t> marks;
    for (int k = 0; k < 3; ++k) {
      std::memcpy(x.data(), xs[k].data(), x.nbytes());
      ff.forward(x, y);
      {
        deferred_weight_grads::scope in(q[k]);
        REQUIRE(deferred_weight_grads::active() == &q[k]);
        ff.backward(rs[k], dx);
        q[k].mark(k);
      }
      CHECK(deferred_weight_grads::active() == nullptr);
      CHECK(values(dx) == plain_dx[k]);  // dx needs no weight gradient
      CHECK(!q[k].empty());
    }
    // Nothing reached the weight gradients yet (norm-free MLP: every parameter is a linear's).
    for (std::int64_t i = 0; i < mem.grads().numel(); ++i)
      REQUIRE(mem.grads().data_as<double>()[i] == 0.0);
    for (int k = 0; k < 3; ++k) q[k].run([&](std::int64_t b) { marks.push_back(b); });
    CHECK(same_bits(mem.grads(), plain));
    CHECK(marks == std::vector<std::int64_t>{0, 1, 2});
    CHECK(q[0].empty());

    // The queue's buffers are reused: a second round gives the same sums again.
    mem.zero_grads();
    const auto bytes = q[0].buffer_bytes();
    CHECK(bytes > 0);
    for (int k = 0; k < 3; ++k) {
      std::memcpy(x.data(), xs[k].data(), x.nbytes());
      ff.forward(x, y);
      deferred_weight_grads::scope in(q[k]);
      ff.backward(rs[k], dx);
    }
    for (int k = 0; k < 3; ++k) q[k].run({});
    CHECK(same_bits(mem.grads(), plain));
    CHECK(q[0].buffer_bytes() == bytes);
  }
}
