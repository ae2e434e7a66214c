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
// tp partial products; the allreduce adds them in its own order). Each output is a sum of at most
// ~64 f32 products, so reassociation moves it by at most ~64 * 2^-24 ~ 4e-6 of the sum of
// magnitudes; we allow 2e-5 of the largest reference magnitude for a layer and 1e-4 for the whole
// block (LayerNorm's rstd and the chained layers amplify differences a few times). A wrong slice,
// a missing reduction or a doubled bias gives errors of order 1.
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

using namespace troupe;
using namespace troupe::models;

namespace {

using vec = std::vector<float>;

vec to_vec(const tensor& t) {
  auto c = empty(t.sizes(), dtype::f32);
  ops::copy(t, c);
  const float* p = c.data_as<float>();
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

// max |a - b| / max |b| (b the reference).
double rel_err(const vec& a, const vec& b) {
  REQUIRE(a.size() == b.size());
  double m = 0, s = 1e-12;
  for (std::size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
    s = std::max(s, static_cast<double>(std::abs(b[i])));
  }
  return m / s;
}

// What a shard reports back to the test thread (Catch2 assertions stay on that thread).
struct shard_result {
  vec y, dx, grads, expected_grads;
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

// One shard: forward x -> y, backward dy -> dx, then the expected parameter gradients via
// load_from(grads_of(full)). `layer` has been declared in `s` and bound in `mem`.
template <class Layer, class Full>
void run_shard(Layer& layer, const Full& full, layer_memory& mem, const tensor& x, const tensor& dy,
               shard_result& res) {
  layer.load_from(full);
  mem.zero_grads();
  auto y = zeros(dy.sizes(), dtype::f32);
  auto dx = zeros(x.sizes(), dtype::f32);
  layer.forward(x, y);
  layer.backward(dy, dx);
  res.y = to_vec(y);
  res.dx = to_vec(dx);
  res.grads = to_vec(mem.grads());
  layer.load_from(grads_of(full));
  res.expected_grads = to_vec(mem.params());
}

struct reference {
  owned_tensor x, y, dy, dx;
};

// Forward and backward of an unsharded layer on random x and dy [B, T, C].
template <class Full>
reference run_full(Full& full, const shape& in, const shape& out, std::uint64_t seed) {
  std::mt19937_64 g(seed);
  reference r{empty(in, dtype::f32), zeros(out, dtype::f32), empty(out, dtype::f32),
              zeros(in, dtype::f32)};
  fill_random(r.x, g);
  fill_random(r.dy, g);
  full.forward(r.x, r.y);
  full.backward(r.dy, r.dx);
  return r;
}

void check_results(const std::vector<shard_result>& res, const reference& ref, int tp, bool sp,
                   int y_dim, int dx_dim, double tol) {
  for (int r = 0; r < tp; ++r) {
    INFO("rank " << r << " of " << tp << (sp ? " with SP" : ""));
    vec ey = y_dim >= 0 ? slice(ref.y, y_dim, r, tp) : expected_activation(ref.y, r, tp, sp);
    vec edx = dx_dim >= 0 ? slice(ref.dx, dx_dim, r, tp) : expected_activation(ref.dx, r, tp, sp);
    CHECK(rel_err(res[r].y, ey) < tol);
    CHECK(rel_err(res[r].dx, edx) < tol);
    CHECK(rel_err(res[r].grads, res[r].expected_grads) < tol);
    CHECK(std::any_of(res[r].grads.begin(), res[r].grads.end(), [](float v) { return v != 0; }));
  }
}

constexpr std::int64_t B = 2, T = 4, C = 16;

}  // namespace

TEST_CASE("Column and row parallel linears match the unsharded linear", "[parallel]") {
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      // Column parallel: output columns split (or gathered back without SP).
      for (bool gather : sp ? std::vector<bool>{false} : std::vector<bool>{false, true}) {
        INFO("column parallel gather_output " << gather);
        linear full({C, 12, true});
        slot_list fs;
        full.declare(fs, "fc");
        layer_memory fm(fs, dtype::f32);
        randomize(fs, 11);
        reference ref = run_full(full, {B, T, C}, {B, T, 12}, 12);
        auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
          column_parallel_linear l({.in = C, .out = 12, .bias = true, .gather_output = gather}, g);
          slot_list s;
          l.declare(s, "fc", {B, T});
          layer_memory m(s, dtype::f32);
          auto x = shard_input(ref.x, r, tp, sp);
          owned_tensor dy = empty(gather ? shape{B, T, 12} : shape{B, T, 12 / tp}, dtype::f32);
          if (gather)
            ops::copy(ref.dy, dy);
          else
            copy_shard(ref.dy, 2, r, tp, dy);
          run_shard(l, full, m, x, dy, out);
        });
        check_results(res, ref, tp, sp, gather ? -1 : 2, -1, 2e-5);
        if (gather)  // every shard holds the whole output
          for (int r = 0; r < tp; ++r) CHECK(rel_err(res[r].y, to_vec(ref.y)) < 2e-5);
      }
      // Row parallel: input features split; output reduced (SP: scattered on the sequence).
      {
        INFO("row parallel");
        linear full({C, 12, true});
        slot_list fs;
        full.declare(fs, "proj");
        layer_memory fm(fs, dtype::f32);
        randomize(fs, 13);
        reference ref = run_full(full, {B, T, C}, {B, T, 12}, 14);
        auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
          row_parallel_linear l({.in = C, .out = 12, .bias = true}, g);
          slot_list s;
          l.declare(s, "proj", {B, T});
          layer_memory m(s, dtype::f32);
          auto x = empty({B, T, C / tp}, dtype::f32);
          copy_shard(ref.x, 2, r, tp, x);
          auto dy = shard_input(ref.dy, r, tp, sp);
          run_shard(l, full, m, x, dy, out);
        });
        for (int r = 0; r < tp; ++r) {
          INFO("rank " << r);
          CHECK(rel_err(res[r].y, expected_activation(ref.y, r, tp, sp)) < 2e-5);
          CHECK(rel_err(res[r].dx, slice(ref.dx, 2, r, tp)) < 2e-5);
          CHECK(rel_err(res[r].grads, res[r].expected_grads) < 2e-5);
        }
      }
    }
}

TEST_CASE("The tensor parallel MLP matches the unsharded MLP", "[parallel]") {
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      mlp full({.dim = C, .hidden = 4 * C});
      slot_list fs;
      full.declare(fs, "mlp", {B, T});
      layer_memory fm(fs, dtype::f32);
      randomize(fs, 21);
      reference ref = run_full(full, {B, T, C}, {B, T, C}, 22);
      auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
        tp_mlp l({.dim = C, .hidden = 4 * C}, g);
        slot_list s;
        l.declare(s, "mlp", {B, T});
        layer_memory m(s, dtype::f32);
        run_shard(l, full, m, shard_input(ref.x, r, tp, sp), shard_input(ref.dy, r, tp, sp), out);
      });
      check_results(res, ref, tp, sp, -1, -1, 2e-5);
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
        attention full(cfg);
        slot_list fs;
        full.declare(fs, "attn", {B, T});
        layer_memory fm(fs, dtype::f32);
        randomize(fs, 31);
        reference ref = run_full(full, {B, T, C}, {B, T, C}, 32);
        auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
          tp_attention l(cfg, g);
          slot_list s;
          l.declare(s, "attn", {B, T});
          layer_memory m(s, dtype::f32);
          run_shard(l, full, m, shard_input(ref.x, r, tp, sp), shard_input(ref.dy, r, tp, sp), out);
        });
        check_results(res, ref, tp, sp, -1, -1, 2e-5);
      }
}

TEST_CASE("A GPT-2 block in tp2 and tp2 with sequence parallelism matches the unsharded block",
          "[parallel]") {
  gpt_block::config cfg{.dim = C, .n_head = 4};
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      gpt_block full(cfg);
      slot_list fs;
      full.declare(fs, "h.0", {B, T});
      layer_memory fm(fs, dtype::f32);
      randomize(fs, 41);
      reference ref = run_full(full, {B, T, C}, {B, T, C}, 42);
      auto res = run_ranks(tp, sp, [&](int r, tp_group g, shard_result& out) {
        tp_gpt_block l(cfg, g);
        slot_list s;
        l.declare(s, "h.0", {B, T});
        layer_memory m(s, dtype::f32);
        run_shard(l, full, m, shard_input(ref.x, r, tp, sp), shard_input(ref.dy, r, tp, sp), out);
      });
      check_results(res, ref, tp, sp, -1, -1, 1e-4);
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
        // One shard owns each row and the others add zeros: exact.
        CHECK(res[r].y == expected_activation(y, r, tp, sp));
        CHECK(rel_err(res[r].grads, res[r].expected_grads) < 1e-6);
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
  cross_entropy_loss full;
  slot_list fs;
  full.declare(fs, "loss", {B, T});
  layer_memory fm(fs, dtype::f32);
  double loss = full.forward(logits, targets);
  auto dlogits = empty({N, V}, dtype::f32);
  full.backward(dlogits, 0.5);
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
      // The per-row statistics are the same sums in f64, rounded to f32 once: a few ulp.
      CHECK(std::abs(res[r].loss - loss) < 1e-5 * std::abs(loss));
      CHECK(rel_err(res[r].dx, slice(dlogits, 1, r, tp)) < 1e-5);
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
