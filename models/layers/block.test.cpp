// The pre-norm transformer block that models compose (models/gpt.hpp):
//   r = x + attn(ln_1(x));  y = r + mlp(ln_2(r))
// checked end to end against finite differences in f64, run in f32 against the f64 result, and
// on a GPU against the CPU.
#include <catch2/catch.hpp>

#include "memory/gpu.hpp"
#include "models/gpt.hpp"
#include "models/layers/testing.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

using block = gpt_block;

TEST_CASE("A transformer block composed of layers matches finite differences end to end", "[cpu]") {
  rng g(201);
  for (bool rope : {false, true}) {
    INFO("rope " << rope);
    block blk({.dim = 8, .n_head = 4, .n_kv_head = rope ? 2 : 4, .rope = rope});
    slot_list s;
    blk.declare(s, "h.0", {2, 3});
    layer_memory mem(s, dtype::f64);
    randomize_params(s, g);
    auto x = random_tensor({2, 3, 8}, g);
    auto y = host_zeros({2, 3, 8});
    auto r = random_tensor({2, 3, 8}, g);
    auto dx = host_zeros({2, 3, 8});
    auto loss = [&] {
      blk.forward(x, y);
      return dot(y, r);
    };
    loss();
    blk.backward(r, dx);
    check_gradient("dx", x, values(dx), loss, g, {.max_elems = 48});
    check_param_gradients(s, loss, g, {.max_elems = 30});
    check_accumulation(
        mem, [&] { blk.backward(r, dx); }, dx);
    // The scratch of sibling layers shares bytes.
    CHECK(mem.scratch_bytes() < mem.scratch_bytes_without_reuse());
  }
}

TEST_CASE("The same block in f32 agrees with f64", "[cpu]") {
  // Three copies of one block: b64 (exact), b32 (under test: the same weights and inputs, which
  // are f32 values) and bu, in f64 with every weight and input moved by one unit roundoff of f32
  // (x (1 +- u), u = 2^-24, random signs). bu's distance to b64 is how much this block amplifies
  // one rounding of its inputs; an f32 evaluation is (backward stability) the exact one of inputs
  // moved by the roundings along its path, a few dozen per value here, which add as a random
  // walk. So b32 must be about as close to b64 as bu is: within default_k of it, with the floor of
  // tests/rounding.hpp (measured: 2.5 times at most). A wrong f32 kernel is off by O(1) of the
  // tensor, 1e5 times the bound.
  rng g(202);
  block b64({.dim = 16, .n_head = 4, .n_kv_head = 2, .rope = true});
  block b32({.dim = 16, .n_head = 4, .n_kv_head = 2, .rope = true});
  block bu({.dim = 16, .n_head = 4, .n_kv_head = 2, .rope = true});
  slot_list s64, s32, su;
  b64.declare(s64, "h", {2, 6});
  b32.declare(s32, "h", {2, 6});
  bu.declare(su, "h", {2, 6});
  layer_memory m64(s64, dtype::f64), m32(s32, dtype::f32), mu(su, dtype::f64);
  randomize_params(s64, g);
  auto to_f32 = [](const tensor& src, const tensor& dst) {
    for (std::int64_t i = 0; i < src.numel(); ++i)
      ptr<float>(dst)[i] = static_cast<float>(ptr(src)[i]);
  };
  // The f32 values widened back: b64 and bu start from exactly what b32 holds.
  auto round_to_f32 = [](const tensor& t) {
    for (std::int64_t i = 0; i < t.numel(); ++i)
      ptr(t)[i] = static_cast<double>(static_cast<float>(ptr(t)[i]));
  };
  auto nudge = [&](const tensor& src, const tensor& dst) {
    for (std::int64_t i = 0; i < src.numel(); ++i)
      ptr(dst)[i] = ptr(src)[i] * (1 + (g.integer(0, 1) ? 1 : -1) * tests::f32_u);
  };
  for (std::size_t i = 0; i < s64.slots().size(); ++i)
    if (s64.slots()[i].kind == slot_kind::param) {
      round_to_f32(*s64.slots()[i].field);
      to_f32(*s64.slots()[i].field, *s32.slots()[i].field);
      nudge(*s64.slots()[i].field, *su.slots()[i].field);
    }
  auto x64 = random_tensor({2, 6, 16}, g);
  auto r64 = random_tensor({2, 6, 16}, g);
  round_to_f32(x64);
  round_to_f32(r64);
  auto x32 = empty({2, 6, 16}, dtype::f32), r32 = empty({2, 6, 16}, dtype::f32);
  auto xu = host_zeros({2, 6, 16}), ru = host_zeros({2, 6, 16});
  to_f32(x64, x32);
  to_f32(r64, r32);
  nudge(x64, xu);
  nudge(r64, ru);
  auto y64 = host_zeros({2, 6, 16}), dx64 = host_zeros({2, 6, 16});
  auto yu = host_zeros({2, 6, 16}), dxu = host_zeros({2, 6, 16});
  auto y32 = host_zeros({2, 6, 16}, dtype::f32), dx32 = host_zeros({2, 6, 16}, dtype::f32);
  b64.forward(x64, y64);
  b64.backward(r64, dx64);
  bu.forward(xu, yu);
  bu.backward(ru, dxu);
  b32.forward(x32, y32);
  b32.backward(r32, dx32);
  auto widen = [](const tensor& t) {
    std::vector<double> v(t.numel());
    for (std::int64_t i = 0; i < t.numel(); ++i) v[i] = ptr<float>(t)[i];
    return v;
  };
  auto judge = [&](const std::string& what, const tensor& t32, const tensor& tu,
                   const tensor& t64) {
    const auto v = tests::as_accurate_as(widen(t32), values(tu), values(t64));
    INFO(what << ": " << v.str());
    CHECK(v.ok());
  };
  judge("y", y32, yu, y64);
  judge("dx", dx32, dxu, dx64);
  for (std::size_t i = 0; i < s64.slots().size(); ++i) {
    const auto& p = s64.slots()[i];
    if (p.kind != slot_kind::param) continue;
    judge(p.name, *s32.slots()[i].grad, *su.slots()[i].grad, *p.grad);
  }
}

TEST_CASE("The same block on a GPU agrees with the CPU", "[gpu]") {
  if (!memory::gpu_available()) {
    WARN("troupe-skip: no GPU");
    return;
  }
  rng g(203);
  const device gpu = device::cuda();
  block cpu_blk({.dim = 16, .n_head = 4, .n_kv_head = 2, .rope = true});
  block gpu_blk({.dim = 16, .n_head = 4, .n_kv_head = 2, .rope = true});
  slot_list sc, sg;
  cpu_blk.declare(sc, "h", {2, 6});
  gpu_blk.declare(sg, "h", {2, 6});
  layer_memory mc(sc, dtype::f32), mg(sg, dtype::f32, gpu);
  auto random_f32 = [&](const shape& s) {
    auto t = empty(s, dtype::f32);
    for (std::int64_t i = 0; i < t.numel(); ++i)
      ptr<float>(t)[i] = static_cast<float>(g.uniform(-1, 1));
    return t;
  };
  for (std::size_t i = 0; i < sc.slots().size(); ++i) {
    const auto& p = sc.slots()[i];
    if (p.kind != slot_kind::param) continue;
    auto v = random_f32(p.sizes);
    for (std::int64_t j = 0; j < v.numel(); ++j) ptr<float>(v)[j] *= 0.5f;
    std::memcpy(p.field->data(), v.data(), v.nbytes());
    ops::copy(to_device(v, gpu), *sg.slots()[i].field);
  }
  auto x = random_f32({2, 6, 16}), r = random_f32({2, 6, 16});
  auto y = host_zeros({2, 6, 16}, dtype::f32), dx = host_zeros({2, 6, 16}, dtype::f32);
  auto xg = to_device(x, gpu), rg = to_device(r, gpu);
  auto yg = empty({2, 6, 16}, dtype::f32, gpu), dxg = empty({2, 6, 16}, dtype::f32, gpu);
  cpu_blk.forward(x, y);
  cpu_blk.backward(r, dx);
  gpu_blk.forward(xg, yg);
  gpu_blk.backward(rg, dxg);
  auto host = [](const tensor& t) {
    auto h = to_device(t, device::cpu());
    std::vector<double> v(h.numel());
    for (std::int64_t i = 0; i < h.numel(); ++i) v[i] = ptr<float>(h)[i];
    return v;
  };
  // Both in f32 with f32 accumulation: differences are rounding, ~1e-6 relative.
  CHECK(max_rel_diff(host(yg), host(y), 1e-2) <= 1e-4);
  CHECK(max_rel_diff(host(dxg), host(dx), 1e-2) <= 1e-4);
  for (std::size_t i = 0; i < sc.slots().size(); ++i) {
    const auto& p = sc.slots()[i];
    if (p.kind != slot_kind::param) continue;
    INFO(p.name);
    CHECK(max_rel_diff(host(*sg.slots()[i].grad), host(*p.grad), 1e-2) <= 1e-4);
  }
}
