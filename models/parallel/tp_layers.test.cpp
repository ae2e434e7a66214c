// The tensor-parallel layers against the unsharded layers of models/layers: ranks are threads of a
// local group (collective/local); every shard's forward output, input gradient and parameter
// gradients must equal the matching slice of the unsharded layer's, in f32, with and without
// sequence parallelism.
//
// Parameter gradients are compared through the same slicing as the weights: after backward a
// shard's gradients are saved, then load_from is called on the unsharded layer with its gradients
// in place of its weights, which writes the expected slices into the shard's parameters; the two
// flat arenas (same layout) must agree.
//
// Tolerance: the shards compute the same sums in another association (a row-parallel matmul sums
// tp partial products; the allreduce adds them in its own order), so they differ from the
// unsharded f32 layer by rounding whose size depends on the CPU's kernels. Each layer is run a
// third time in f64 (the same weights and inputs, widened exactly): every shard output must be as
// accurate as the unsharded f32 layer's against it (tests/rounding.hpp). A wrong slice, a missing
// reduction or a doubled bias gives errors of order 1, 1e5 times the bound.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/gpt.hpp"
#include "models/layers/cross_entropy.hpp"
#include "models/parallel/tp_layers.hpp"
#include "models/parallel/tp_vocab.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

using vec = std::vector<double>;

// Every element of t (f32 or f64), in f64 (exact).
vec to_vec(const tensor& t) {
  auto c = empty(t.sizes(), dtype::f64);
  ops::copy(t, c);
  const double* p = c.data_as<double>();
  return vec(p, p + c.numel());
}

void fill_random(const tensor& t, std::mt19937_64& g, double scale = 1.0) {
  std::uniform_real_distribution<float> d(static_cast<float>(-scale), static_cast<float>(scale));
  auto c = empty(t.sizes(), dtype::f32);
  float* p = c.data_as<float>();
  for (std::int64_t i = 0; i < c.numel(); ++i) p[i] = d(g);
  ops::copy(c, t);
}

void randomize(const slot_list& s, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  for (const auto& slot : s.slots())
    if (slot.kind == slot_kind::param) fill_random(*slot.field, g, 0.5);
}

// The slice `rank` of `tp` of t along dim, as a vector.
vec slice(const tensor& t, int dim, int rank, int tp) {
  std::int64_t n = t.size(dim) / tp;
  return to_vec(t.narrow(dim, rank * n, n));
}

// The parameters' values (grads: their gradients) of `s` in declaration order, in f64: the same
// order for an f32 and an f64 binding of one layer, whatever their arenas' padding.
vec param_values(const slot_list& s, bool grads) {
  vec out;
  for (const auto& slot : s.slots())
    if (slot.kind == slot_kind::param) {
      vec v = to_vec(grads ? *slot.grad : *slot.field);
      out.insert(out.end(), v.begin(), v.end());
    }
  return out;
}

// got must be as accurate as ref against exact (tests/rounding.hpp).
void check_accurate(const char* what, const vec& got, const vec& ref, const vec& exact) {
  auto v = tests::as_accurate_as(got, ref, exact);
  INFO(what << ": " << v.str());
  CHECK(v.ok());
}

// What a shard reports back to the test thread (Catch2 assertions stay on that thread).
struct shard_result {
  vec y, dx, grads, expected_grads, exact_grads;
  double loss = 0;
};

// Runs fn(rank, group) on one thread per rank of a local group of n; rethrows the first failure
// (after aborting the group so the other ranks do not wait for it).
std::vector<shard_result> run_ranks(int n, bool sp,
                                    const std::function<void(int, tp_group, shard_result&)>& fn) {
  auto comms = collective::make_local_group(n);
  std::vector<shard_result> out(n);
  std::vector<std::exception_ptr> err(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r, tp_group{comms[r].get(), sp}, out[r]);
      } catch (...) {
        err[r] = std::current_exception();
        for (auto& c : comms) c->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
  return out;
}

// The unsharded layers with their gradients in place of their parameters (for load_from).
linear grads_of(linear l) {
  l.weight = l.dweight;
  l.bias = l.dbias;
  return l;
}
layernorm grads_of(layernorm l) {
  l.weight = l.dweight;
  l.bias = l.dbias;
  return l;
}
attention grads_of(attention a) {
  a.qkv_proj = grads_of(a.qkv_proj);
  a.q_proj = grads_of(a.q_proj);
  a.k_proj = grads_of(a.k_proj);
  a.v_proj = grads_of(a.v_proj);
  a.o_proj = grads_of(a.o_proj);
  return a;
}
mlp grads_of(mlp m) {
  m.fc = grads_of(m.fc);
  m.proj = grads_of(m.proj);
  return m;
}
gpt_block grads_of(gpt_block b) {
  b.ln_1 = grads_of(b.ln_1);
  b.ln_2 = grads_of(b.ln_2);
  b.attn = grads_of(b.attn);
  b.ff = grads_of(b.ff);
  return b;
}
embedding grads_of(embedding e) {
  e.weight = e.dweight;
  return e;
}

// The shard's view of a full [B, T, C] activation: all of it, or with SP its sequence slice.
owned_tensor shard_input(const tensor& full, int r, int tp, bool sp) {
  shape s = full.sizes();
  if (sp) s[1] /= tp;
  auto t = empty(s, dtype::f32);
  if (sp)
    copy_shard(full, 1, r, tp, t);
  else
    ops::copy(full, t);
  return t;
}

vec expected_activation(const tensor& full, int r, int tp, bool sp) {
  return sp ? slice(full, 1, r, tp) : to_vec(full);
}

struct reference {
  owned_tensor x, y, dy, dx;
};

// Forward and backward of an unsharded layer on random x and dy [B, T, C] (f32 draws, held in
// dtype t: an f64 run sees the f32 run's inputs exactly).
template <class Full>
reference run_full(Full& full, const shape& in, const shape& out, std::uint64_t seed,
                   dtype t = dtype::f32) {
  std::mt19937_64 g(seed);
  reference r{empty(in, t), zeros(out, t), empty(out, t), zeros(in, t)};
  fill_random(r.x, g);
  fill_random(r.dy, g);
  full.forward(r.x, r.y);
  full.backward(r.dy, r.dx);
  return r;
}

// An unsharded layer bound in f32 (the reference) and in f64 (exact) with the same weights (seed
// weights) and the same inputs (seed data), after one forward and backward each.
template <class Full>
struct unsharded {
  Full f32, f64;
  slot_list s32, s64;
  layer_memory m32, m64;
  reference ref, exact;
  template <class Make, class Declare>
  unsharded(Make make, Declare declare, std::uint64_t weights, const shape& in, const shape& out,
            std::uint64_t data)
      : f32(make()), f64(make()) {
    declare(f32, s32);
    declare(f64, s64);
    m32 = layer_memory(s32, dtype::f32);
    m64 = layer_memory(s64, dtype::f64);
    randomize(s32, weights);
    randomize(s64, weights);
    ref = run_full(f32, in, out, data);
    exact = run_full(f64, in, out, data, dtype::f64);
  }
};

// A shard layer bound in f32 (under test) and in f64 (to take the exact gradient slices).
template <class Layer>
struct shard_pair {
  Layer l32, l64;
  slot_list s32, s64;
  layer_memory m32, m64;
  template <class Make, class Declare>
  shard_pair(Make make, Declare declare) : l32(make()), l64(make()) {
    declare(l32, s32);
    declare(l64, s64);
    m32 = layer_memory(s32, dtype::f32);
    m64 = layer_memory(s64, dtype::f64);
  }
};

// One shard: forward x -> y, backward dy -> dx, then the expected parameter gradients via
// load_from(grads_of(full)): the f32 layer's slices and the f64 layer's.
template <class Layer, class Full>
void run_shard(shard_pair<Layer>& p, const unsharded<Full>& full, const tensor& x, const tensor& dy,
               shard_result& res) {
  p.l32.load_from(full.f32);
  p.m32.zero_grads();
  auto y = zeros(dy.sizes(), dtype::f32);
  auto dx = zeros(x.sizes(), dtype::f32);
  p.l32.forward(x, y);
  p.l32.backward(dy, dx);
  res.y = to_vec(y);
  res.dx = to_vec(dx);
  res.grads = param_values(p.s32, true);
  p.l32.load_from(grads_of(full.f32));
  res.expected_grads = param_values(p.s32, false);
  p.l64.load_from(grads_of(full.f64));
  res.exact_grads = param_values(p.s64, false);
}

// Every shard's output, input gradient and parameter gradients as accurate as the unsharded f32
// layer's slices against the f64 layer's (y_dim, dx_dim >= 0: the shard's slice along that dim;
// -1: the whole tensor, or its sequence slice with SP).
template <class Full>
void check_results(const std::vector<shard_result>& res, const unsharded<Full>& u, int tp, bool sp,
                   int y_dim, int dx_dim) {
  auto part = [&](const tensor& t, int dim, int r) {
    return dim >= 0 ? slice(t, dim, r, tp) : expected_activation(t, r, tp, sp);
  };
  for (int r = 0; r < tp; ++r) {
    INFO("rank " << r << " of " << tp << (sp ? " with SP" : ""));
    check_accurate("y", res[r].y, part(u.ref.y, y_dim, r), part(u.exact.y, y_dim, r));
    check_accurate("dx", res[r].dx, part(u.ref.dx, dx_dim, r), part(u.exact.dx, dx_dim, r));
    check_accurate("grads", res[r].grads, res[r].expected_grads, res[r].exact_grads);
    CHECK(std::any_of(res[r].grads.begin(), res[r].grads.end(), [](double v) { return v != 0; }));
  }
}

constexpr std::int64_t B = 2, T = 4, C = 16;

}  // namespace

TEST_CASE("Column and row parallel linears match the unsharded linear", "[parallel]") {
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      // Column parallel: output columns split (or gathered back without SP: every shard holds the
      // whole output).
      for (bool gather : sp ? std::vector<bool>{false} : std::vector<bool>{false, true}) {
        INFO("column parallel gather_output " << gather);
        unsharded<linear> full(
            [] {
              return linear({C, 12, true});
            },
            [](linear& l, slot_list& s) { l.declare(s, "fc"); }, 11, {B, T, C}, {B, T, 12}, 12);
        const reference& ref = full.ref;
        auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
          shard_pair<column_parallel_linear> l(
              [&] {
                return column_parallel_linear(
                    {.in = C, .out = 12, .bias = true, .gather_output = gather}, g);
              },
              [](column_parallel_linear& l, slot_list& s) {
                l.declare(s, "fc", {B, T});
              });
          auto x = shard_input(ref.x, r, tp, sp);
          owned_tensor dy = empty(gather ? shape{B, T, 12} : shape{B, T, 12 / tp}, dtype::f32);
          if (gather)
            ops::copy(ref.dy, dy);
          else
            copy_shard(ref.dy, 2, r, tp, dy);
          run_shard(l, full, x, dy, out);
        });
        check_results(res, full, tp, sp, gather ? -1 : 2, -1);
      }
      // Row parallel: input features split; output reduced (SP: scattered on the sequence).
      {
        INFO("row parallel");
        unsharded<linear> full(
            [] {
              return linear({C, 12, true});
            },
            [](linear& l, slot_list& s) { l.declare(s, "proj"); }, 13, {B, T, C}, {B, T, 12}, 14);
        const reference& ref = full.ref;
        auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
          shard_pair<row_parallel_linear> l(
              [&] { return row_parallel_linear({.in = C, .out = 12, .bias = true}, g); },
              [](row_parallel_linear& l, slot_list& s) {
                l.declare(s, "proj", {B, T});
              });
          auto x = empty({B, T, C / tp}, dtype::f32);
          copy_shard(ref.x, 2, r, tp, x);
          auto dy = shard_input(ref.dy, r, tp, sp);
          run_shard(l, full, x, dy, out);
        });
        check_results(res, full, tp, sp, -1, 2);
      }
    }
}

TEST_CASE("The tensor parallel MLP matches the unsharded MLP", "[parallel]") {
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      unsharded<mlp> full([] { return mlp({.dim = C, .hidden = 4 * C}); },
                          [](mlp& l, slot_list& s) {
                            l.declare(s, "mlp", {B, T});
                          },
                          21, {B, T, C}, {B, T, C}, 22);
      auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
        shard_pair<tp_mlp> l([&] { return tp_mlp({.dim = C, .hidden = 4 * C}, g); },
                             [](tp_mlp& l, slot_list& s) {
                               l.declare(s, "mlp", {B, T});
                             });
        run_shard(l, full, shard_input(full.ref.x, r, tp, sp), shard_input(full.ref.dy, r, tp, sp),
                  out);
      });
      check_results(res, full, tp, sp, -1, -1);
    }
}

TEST_CASE("Tensor parallel attention splits the heads and matches the unsharded attention",
          "[parallel]") {
  struct variant {
    std::int64_t n_head, n_kv_head;
    bool fused, rope;
  };
  for (int tp : {2, 4})
    for (bool sp : {false, true})
      for (variant v :
           {variant{4, 4, true, false}, variant{8, 4, true, true}, variant{4, 4, false, true}}) {
        INFO("tp " << tp << " sp " << sp << " heads " << v.n_head << "/" << v.n_kv_head << " fused "
                   << v.fused << " rope " << v.rope);
        attention::config cfg{.dim = C,
                              .n_head = v.n_head,
                              .n_kv_head = v.n_kv_head,
                              .head_dim = 4,
                              .fused_qkv = v.fused,
                              .rope = v.rope};
        unsharded<attention> full([&] { return attention(cfg); },
                                  [](attention& l, slot_list& s) {
                                    l.declare(s, "attn", {B, T});
                                  },
                                  31, {B, T, C}, {B, T, C}, 32);
        auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
          shard_pair<tp_attention> l([&] { return tp_attention(cfg, g); },
                                     [](tp_attention& l, slot_list& s) {
                                       l.declare(s, "attn", {B, T});
                                     });
          run_shard(l, full, shard_input(full.ref.x, r, tp, sp),
                    shard_input(full.ref.dy, r, tp, sp), out);
        });
        check_results(res, full, tp, sp, -1, -1);
      }
}

TEST_CASE("A GPT-2 block in tp2 and tp2 with sequence parallelism matches the unsharded block",
          "[parallel]") {
  gpt_block::config cfg{.dim = C, .n_head = 4};
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      unsharded<gpt_block> full([&] { return gpt_block(cfg); },
                                [](gpt_block& l, slot_list& s) {
                                  l.declare(s, "h.0", {B, T});
                                },
                                41, {B, T, C}, {B, T, C}, 42);
      auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
        shard_pair<tp_gpt_block> l([&] { return tp_gpt_block(cfg, g); },
                                   [](tp_gpt_block& l, slot_list& s) {
                                     l.declare(s, "h.0", {B, T});
                                   });
        run_shard(l, full, shard_input(full.ref.x, r, tp, sp), shard_input(full.ref.dy, r, tp, sp),
                  out);
      });
      check_results(res, full, tp, sp, -1, -1);
    }
}

TEST_CASE("The vocab parallel embedding matches the unsharded embedding", "[parallel]") {
  constexpr std::int64_t V = 16;
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      embedding full({.vocab = V, .dim = C});
      slot_list fs;
      full.declare(fs, "wte");
      layer_memory fm(fs, dtype::f32);
      randomize(fs, 51);
      auto ids = empty({B, T}, dtype::i32);
      std::mt19937_64 g(52);
      for (std::int64_t i = 0; i < B * T; ++i)
        ids.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(g() % V);
      auto y = zeros({B, T, C}, dtype::f32);
      auto dy = empty({B, T, C}, dtype::f32);
      fill_random(dy, g);
      full.forward(ids, y);
      full.backward(dy);
      auto res = run_ranks(tp, sp, [&](int r, tp_group grp, shard_result& out) {
        vocab_parallel_embedding l({.vocab = V, .dim = C}, grp);
        slot_list s;
        l.declare(s, "wte", {B, T});
        layer_memory m(s, dtype::f32);
        l.load_from(full);
        m.zero_grads();
        auto yl = zeros({B, sp ? T / tp : T, C}, dtype::f32);
        l.forward(ids, yl);
        l.backward(shard_input(dy, r, tp, sp));
        out.y = to_vec(yl);
        out.grads = to_vec(m.grads());
        l.load_from(grads_of(full));
        out.expected_grads = to_vec(m.params());
      });
      for (int r = 0; r < tp; ++r) {
        INFO("rank " << r);
        // One shard owns each row and the others add zeros: exact. Each owned row's gradient adds
        // the same dy rows in the same token order as the unsharded embedding: bit for bit.
        CHECK(res[r].y == expected_activation(y, r, tp, sp));
        CHECK(res[r].grads == res[r].expected_grads);
      }
    }
}

TEST_CASE("The vocab parallel cross entropy matches the unsharded loss and logits gradient",
          "[parallel]") {
  constexpr std::int64_t V = 24, N = B * T;
  std::mt19937_64 g(61);
  auto logits = empty({N, V}, dtype::f32);
  fill_random(logits, g, 4.0);
  auto targets = empty({N}, dtype::i32);
  for (std::int64_t i = 0; i < N; ++i)
    targets.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(g() % V);
  targets.data_as<std::int32_t>()[3] = -100;  // ignored
  // The unsharded loss in f32 (the reference) and in f64 on the same logits (exact).
  cross_entropy_loss full, full64;
  slot_list fs, fs64;
  full.declare(fs, "loss", {B, T});
  full64.declare(fs64, "loss", {B, T});
  layer_memory fm(fs, dtype::f32), fm64(fs64, dtype::f64);
  auto logits64 = empty({N, V}, dtype::f64);
  ops::copy(logits, logits64);
  const double loss = full.forward(logits, targets), loss64 = full64.forward(logits64, targets);
  auto dlogits = empty({N, V}, dtype::f32), dlogits64 = empty({N, V}, dtype::f64);
  full.backward(dlogits, 0.5);
  full64.backward(dlogits64, 0.5);
  for (int tp : {2, 4}) {
    INFO("tp " << tp);
    auto res = run_ranks(tp, false, [&](int r, tp_group grp, shard_result& out) {
      vocab_parallel_cross_entropy l({.vocab = V}, grp);
      slot_list s;
      l.declare(s, "loss", {B, T});
      layer_memory m(s, dtype::f32);
      auto local = empty({N, V / tp}, dtype::f32);
      copy_shard(logits, 1, r, tp, local);
      out.loss = l.forward(local, targets);
      l.backward(local, 0.5);  // in place, as a language model does
      out.dx = to_vec(local);
    });
    for (int r = 0; r < tp; ++r) {
      INFO("rank " << r);
      // The per-row statistics are the same sums in f64, rounded to f32 once: as accurate as the
      // unsharded loss (a few ulp).
      check_accurate("cross entropy loss", {res[r].loss}, {loss}, {loss64});
      check_accurate("cross entropy dx", res[r].dx, slice(dlogits, 1, r, tp),
                     slice(dlogits64, 1, r, tp));
    }
  }
}

TEST_CASE("Bad divisibility by the tensor parallel size names the quantity", "[parallel]") {
  auto comms = collective::make_local_group(2);
  tp_group g{comms[0].get(), false};
  CHECK_THROWS_WITH(tp_attention({.dim = 12, .n_head = 3}, g), Catch::Contains("n_head"));
  CHECK_THROWS_WITH(tp_attention({.dim = 16, .n_head = 4, .n_kv_head = 1}, g),
                    Catch::Contains("n_kv_head"));
  CHECK_THROWS_WITH(vocab_parallel_embedding({.vocab = 15, .dim = 8}, g), Catch::Contains("vocab"));
  CHECK_THROWS_WITH(vocab_parallel_cross_entropy({.vocab = 15}, g), Catch::Contains("vocab"));
  CHECK_THROWS_WITH(tp_mlp({.dim = 8, .hidden = 9}, g), Catch::Contains("out features"));
  CHECK_THROWS_WITH(row_parallel_linear({.in = 9, .out = 8}, g), Catch::Contains("in features"));
  tp_gpt_block blk({.dim = 16, .n_head = 4}, tp_group{comms[0].get(), true});
  slot_list s;
  CHECK_THROWS_WITH(blk.declare(s, "h.0", {1, 5}), Catch::Contains("sequence length"));
}

TEST_CASE("One shard's 16-bit token log-probabilities are the targets' log-probabilities",
          "[parallel]") {
  // A pipeline stage without tensor parallelism (tp_group{}) runs the fused kernel, which writes
  // each row's loss in the logits' type; a token objective (DPO, GRPO) reads them as log p.
  const std::int64_t B = 2, T = 3, N = B * T, V = 24;
  std::mt19937_64 g(7);
  auto logits32 = empty({N, V}, dtype::f32);
  fill_random(logits32, g, 4.0);
  auto targets = empty({N}, dtype::i32);
  for (std::int64_t i = 0; i < N; ++i)
    targets.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(g() % V);
  targets.data_as<std::int32_t>()[2] = -100;  // ignored: log p 0
  for (dtype t : {dtype::bf16, dtype::f16}) {
    INFO(dtype_name(t));
    vocab_parallel_cross_entropy l({.vocab = V}, tp_group{});
    slot_list s;
    l.declare(s, "loss", {B, T});
    layer_memory m(s, t);
    auto logits = empty({N, V}, t);
    ops::copy(logits32, logits);
    auto wide = empty({N, V}, dtype::f64);  // the 16-bit logits, exactly
    ops::copy(logits, wide);
    l.forward(logits, targets);
    const auto lp = l.token_logprobs();
    REQUIRE(lp.size() == static_cast<std::size_t>(N));
    // Each log p is computed in f32 and rounded once to the 16-bit type (a relative half ulp:
    // 2^-9 for bf16, 2^-12 for f16); 2^-8 of |log p| bounds both, while reading the 16-bit values
    // as f32 statistics gives numbers off by orders of magnitude.
    for (std::int64_t i = 0; i < N; ++i) {
      const auto tg = targets.data_as<std::int32_t>()[i];
      if (tg < 0) {
        CHECK(lp[static_cast<std::size_t>(i)] == 0.0);
        continue;
      }
      const double* row = wide.data_as<double>() + i * V;
      double mx = row[0], se = 0;
      for (std::int64_t v = 0; v < V; ++v) mx = std::max(mx, row[v]);
      for (std::int64_t v = 0; v < V; ++v) se += std::exp(row[v] - mx);
      const double exact = row[tg] - mx - std::log(se);
      CHECK(std::abs(lp[static_cast<std::size_t>(i)] - exact) <= std::ldexp(std::abs(exact), -8));
    }
  }
}
