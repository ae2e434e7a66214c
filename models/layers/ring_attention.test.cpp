// ring_attention against the single-rank flash attention on the whole sequence: forward output and
// log-sum-exp, backward dq, dk, dv, for cp = 2 and 4, causal, multi-head and grouped-query heads,
// the contiguous and the zigzag layouts, and q, k, v as views of a fused buffer; ranks as threads
// over the local transport (over UCX processes: tests/multirank/ring_attention.test.cpp, through
// `troupe bench ring-attention --check`, since a fork from this process would inherit a tensor
// thread pool whose workers are gone). Also the sequence split helpers.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <tuple>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/layers/ring_attention.hpp"
#include "models/layers/sequence_split.hpp"
#include "models/layers/testing.hpp"
#include "models/parallel/testing.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

namespace troupe::models {
namespace {

using testing::rng;

struct attn_case {
  std::int64_t b = 2, t = 256, hq = 4, hkv = 2, d = 16;
  bool causal = true;
};

// The inputs (q, k, v, dout) and the single-rank results over the whole sequence.
struct full_run {
  owned_tensor q, k, v, dout, out, lse, dq, dk, dv;
};

full_run make_run(const attn_case& c, dtype type) {
  full_run r;
  r.q = empty({c.b, c.t, c.hq, c.d}, type);
  r.k = empty({c.b, c.t, c.hkv, c.d}, type);
  r.v = empty({c.b, c.t, c.hkv, c.d}, type);
  r.dout = empty({c.b, c.t, c.hq, c.d}, type);
  r.out = empty({c.b, c.t, c.hq, c.d}, type);
  // ops::attention's lse is f32 for 16-bit q.
  r.lse = empty({c.b, c.hq, c.t}, type == dtype::bf16 || type == dtype::f16 ? dtype::f32 : type);
  r.dq = empty({c.b, c.t, c.hq, c.d}, type);
  r.dk = empty({c.b, c.t, c.hkv, c.d}, type);
  r.dv = empty({c.b, c.t, c.hkv, c.d}, type);
  return r;
}

// Inputs drawn in f64, rounded to f32: the f32 run and its f64 twin see the same numbers. q is
// scaled up so that the softmax rows are far from uniform (a wrongly weighted block shows).
void fill_inputs(full_run& f32, full_run& f64, std::uint64_t seed) {
  rng g(seed);
  const std::pair<owned_tensor*, owned_tensor*> ins[] = {
      {&f32.q, &f64.q}, {&f32.k, &f64.k}, {&f32.v, &f64.v}, {&f32.dout, &f64.dout}};
  double scale = 3.0;
  for (auto [a, b] : ins) {
    testing::fill_uniform(*b, g, scale);
    scale = 1.0;
    ops::copy(*b, *a);
    ops::copy(*a, *b);
  }
}

void run_single(full_run& r, bool causal) {
  ops::attention_options o{0.0, causal, {}};
  ops::attention(r.q, r.k, r.v, r.out, r.lse, o);
  ops::attention_backward(r.q, r.k, r.v, r.out, r.dout, r.lse, r.dq, r.dk, r.dv, o);
}

// This rank's part of the ring run: its rows of q, k, v, dout in, its rows of out, lse, dq, dk,
// dv written into `got` (full-size; every rank writes only its own rows).
// With `fused`, q, k, v and dq, dk, dv are views of fused [B, Tl, (Hq + 2 Hkv) D] buffers, as
// the attention layer's fused qkv projection hands them over.
void run_ring_rank(collective::communicator& comm, const attn_case& c, sequence_layout layout,
                   const full_run& in, full_run& got, bool fused = false) {
  const int cp = comm.size(), r = comm.rank();
  attn_case lc = c;
  lc.t = c.t / cp;
  full_run loc = make_run(lc, in.q.type());
  owned_tensor qkv, dqkv;
  if (fused) {
    const std::int64_t w = (c.hq + 2 * c.hkv) * c.d;
    qkv = empty({c.b, lc.t, w});
    dqkv = empty({c.b, lc.t, w});
    auto view = [&](const owned_tensor& buf, std::int64_t heads, std::int64_t at) {
      return tensor::strided(buf.data(), buf.nbytes(), dtype::f32, {c.b, lc.t, heads, c.d},
                             {lc.t * w, w, c.d, 1}, at * c.d);
    };
    for (auto [buf, q, k, v] :
         {std::tuple{&qkv, &loc.q, &loc.k, &loc.v}, {&dqkv, &loc.dq, &loc.dk, &loc.dv}}) {
      static_cast<tensor&>(*q) = view(*buf, c.hq, 0);
      static_cast<tensor&>(*k) = view(*buf, c.hkv, c.hq);
      static_cast<tensor&>(*v) = view(*buf, c.hkv, c.hq + c.hkv);
    }
  }
  for (auto [full, part] :
       {std::pair{&in.q, &loc.q}, {&in.k, &loc.k}, {&in.v, &loc.v}, {&in.dout, &loc.dout}})
    split_sequence(*full, cp, r, layout, *part);
  ring_attention_config rc;
  rc.batch = c.b;
  rc.local_seq = lc.t;
  rc.n_head = c.hq;
  rc.n_kv_head = c.hkv;
  rc.head_dim = c.d;
  rc.layout = layout;
  rc.causal = c.causal;
  rc.type = in.q.type();
  ring_attention op(comm, rc);
  op.forward(loc.q, loc.k, loc.v, loc.out, loc.lse);
  op.backward(loc.q, loc.k, loc.v, loc.out, loc.lse, loc.dout, loc.dq, loc.dk, loc.dv);
  for (auto [part, full] :
       {std::pair{&loc.out, &got.out}, {&loc.dq, &got.dq}, {&loc.dk, &got.dk}, {&loc.dv, &got.dv}})
    unsplit_sequence(*part, cp, r, layout, *full);
  // lse is [B, H, T]: split along its last dimension through a [B, T, H] transposed view.
  unsplit_sequence(loc.lse.transpose(1, 2), cp, r, layout, got.lse.transpose(1, 2));
}

// Each result of `got` must be as accurate as the single-rank f32 run against the f64 twin:
// the ring adds the same terms in another order (blocks merged by their log-sum-exps, dq and
// dk/dv summed over blocks), a few roundings per element more, well inside default_k; a block
// left out, merged with a wrong weight or sent to the wrong rank is off by O(|exact|).
// Every element of t (any floating dtype), in f64.
std::vector<double> wide(const tensor& t) {
  owned_tensor w = empty(t.sizes(), dtype::f64);
  ops::copy(t, w);
  return testing::values(w);
}

void expect_as_accurate(const full_run& got, const full_run& ref, const full_run& exact) {
  const std::pair<const char*, const owned_tensor full_run::*> fields[] = {{"out", &full_run::out},
                                                                           {"lse", &full_run::lse},
                                                                           {"dq", &full_run::dq},
                                                                           {"dk", &full_run::dk},
                                                                           {"dv", &full_run::dv}};
  for (auto [name, f] : fields) {
    const auto v = tests::as_accurate_as(wide(got.*f), wide(ref.*f), testing::values(exact.*f));
    INFO(name << ": " << v.str());
    CHECK(v.ok());
  }
}

}  // namespace

TEST_CASE("sequence pieces put zigzag chunk r and 2cp-1-r on rank r, in that order",
          "[models][ring]") {
  const auto z = sequence_pieces(16, 4, 1, sequence_layout::zigzag);
  REQUIRE(z.size() == 2);
  CHECK((z[0].start == 2 && z[0].length == 2 && z[0].local == 0));
  CHECK((z[1].start == 12 && z[1].length == 2 && z[1].local == 2));
  CHECK(local_positions(16, 4, 3, sequence_layout::zigzag) ==
        std::vector<std::int64_t>{6, 7, 8, 9});
  CHECK(local_positions(16, 4, 3, sequence_layout::contiguous) ==
        std::vector<std::int64_t>{12, 13, 14, 15});
  CHECK_THROWS_WITH(sequence_pieces(12, 4, 0, sequence_layout::zigzag),
                    Catch::Contains("12 tokens do not split into 2 cp = 8 zigzag chunks"));
}

TEST_CASE("splitting token ids over cp ranks and putting the parts back gives the ids back",
          "[models][ring]") {
  const auto layout = GENERATE(sequence_layout::contiguous, sequence_layout::zigzag);
  const int cp = GENERATE(1, 2, 4);
  auto ids = empty({2, 16}, dtype::i32);
  for (std::int64_t i = 0; i < ids.numel(); ++i) ids.data_as<std::int32_t>()[i] = int(i * 7 + 1);
  auto back = empty({2, 16}, dtype::i32);
  std::vector<std::int32_t> seen;
  for (int r = 0; r < cp; ++r) {
    auto part = empty({2, 16 / cp}, dtype::i32);
    split_sequence(ids, cp, r, layout, part);
    const auto pos = local_positions(16, cp, r, layout);
    for (std::int64_t j = 0; j < 16 / cp; ++j)  // row 1 of the part holds row 1's tokens at pos
      CHECK(part.data_as<std::int32_t>()[16 / cp + j] == int((16 + pos[j]) * 7 + 1));
    unsplit_sequence(part, cp, r, layout, back);
  }
  CHECK(std::equal(ids.data_as<std::int32_t>(), ids.data_as<std::int32_t>() + 32,
                   back.data_as<std::int32_t>()));
}

TEST_CASE(
    "ring attention matches single-rank attention over the whole sequence, forward and "
    "backward",
    "[models][ring]") {
  const int cp = GENERATE(2, 4);
  const auto layout = GENERATE(sequence_layout::contiguous, sequence_layout::zigzag);
  const std::int64_t hkv = GENERATE(4, 2);  // multi-head, and grouped-query (2 queries per kv)
  attn_case c;
  c.hkv = hkv;
  INFO("cp " << cp << ", " << sequence_layout_name(layout) << ", " << c.hq << " heads, " << hkv
             << " kv heads");
  full_run ref = make_run(c, dtype::f32), exact = make_run(c, dtype::f64);
  fill_inputs(ref, exact, 7 + cp + hkv);
  run_single(ref, c.causal);
  run_single(exact, c.causal);
  full_run got = make_run(c, dtype::f32);
  testing::run_ranks(
      cp, [&](int, collective::communicator& comm) { run_ring_rank(comm, c, layout, ref, got); });
  expect_as_accurate(got, ref, exact);
}

// The fraction of the elements of two 16-bit tensors whose values differ.
double differing(const tensor& got, const tensor& ref) {
  const auto g = wide(got), r = wide(ref);
  std::size_t n = 0;
  for (std::size_t i = 0; i < r.size(); ++i) n += g[i] != r[i];
  return static_cast<double>(n) / static_cast<double>(r.size());
}

TEST_CASE("ring attention in bf16 and f16 is as accurate as single-rank attention in 16 bits",
          "[models][ring]") {
  // The single-rank 16-bit kernel loads q, k, v to f32, computes in f32 and rounds out, dq, dk,
  // dv once; the ring computes each block from the same 16-bit values in f32 (the blocks travel
  // in 16 bits: no rounding, they are the inputs), merges in f32 and rounds once at the end: the
  // same one rounding per result plus f32 summation-order differences, so as accurate as the
  // single-rank run against the f64 twin of the same 16-bit inputs by default_k. A ring that
  // rounded each block's output or its dk/dv accumulators to 16 bits would add cp such roundings,
  // which default_k still allows: the agreement with the kernel's values below catches it.
  const auto type = GENERATE(dtype::bf16, dtype::f16);
  const int cp = GENERATE(2, 4);
  attn_case c;
  INFO(dtype_name(type) << ", cp " << cp);
  full_run ref = make_run(c, type), exact = make_run(c, dtype::f64);
  fill_inputs(ref, exact, 11 + cp);
  run_single(ref, c.causal);
  run_single(exact, c.causal);
  full_run got = make_run(c, type);
  testing::run_ranks(cp, [&](int, collective::communicator& comm) {
    run_ring_rank(comm, c, sequence_layout::zigzag, ref, got);
  });
  expect_as_accurate(got, ref, exact);
  // One rounding, checked sharply: as_accurate_as above allows default_k x the kernel's 16-bit
  // error, which a ring rounding out, dq, dk, dv a few times more (each block's running output,
  // the dk/dv accumulators between hops) still meets. The ring's f32 values differ from the
  // kernel's by summation order only (~1e-6 relative), so rounded once they round to the kernel's
  // own 16-bit values but where a value lies that close to a rounding boundary: measured 0.01% to
  // 0.5% of the elements (f16 dk the most). Rounded at every block they differ in 12% to 37%
  // (measured with the running output and the accumulators rounded per block, cp 2 and 4).
  for (auto [name, f] : {std::pair{"out", &full_run::out},
                         {"dq", &full_run::dq},
                         {"dk", &full_run::dk},
                         {"dv", &full_run::dv}}) {
    const double d = differing(got.*f, ref.*f);
    INFO(name << ": " << 100 * d << "% of the elements differ from the single-rank kernel's");
    CHECK(d <= 0.02);
  }
}

TEST_CASE("ring attention takes q, k, v and dq, dk, dv as views of fused buffers",
          "[models][ring]") {
  attn_case c;
  full_run ref = make_run(c, dtype::f32), exact = make_run(c, dtype::f64);
  fill_inputs(ref, exact, 5);
  run_single(ref, c.causal);
  run_single(exact, c.causal);
  full_run got = make_run(c, dtype::f32);
  testing::run_ranks(2, [&](int, collective::communicator& comm) {
    run_ring_rank(comm, c, sequence_layout::zigzag, ref, got, /*fused=*/true);
  });
  expect_as_accurate(got, ref, exact);
}

TEST_CASE("ring attention without the causal mask matches full attention", "[models][ring]") {
  attn_case c;
  c.causal = false;
  c.t = 128;
  full_run ref = make_run(c, dtype::f32), exact = make_run(c, dtype::f64);
  fill_inputs(ref, exact, 3);
  run_single(ref, c.causal);
  run_single(exact, c.causal);
  full_run got = make_run(c, dtype::f32);
  testing::run_ranks(4, [&](int, collective::communicator& comm) {
    run_ring_rank(comm, c, sequence_layout::contiguous, ref, got);
  });
  expect_as_accurate(got, ref, exact);
}

TEST_CASE("ring attention refuses heads that do not group and an odd zigzag split",
          "[models][ring][faults]") {
  auto comms = collective::make_local_group(1);
  ring_attention_config rc;
  rc.batch = 1;
  rc.local_seq = 7;
  rc.n_head = 4;
  rc.n_kv_head = 3;
  rc.head_dim = 8;
  try {
    ring_attention op(*comms[0], rc);
    FAIL("accepted 4 heads over 3 kv heads");
  } catch (const troupe::error& e) {
    std::printf("faults: ring_attention 4 heads over 3 kv heads -> refused: %s\n", e.what());
    CHECK_THAT(e.what(), Catch::Contains("n_head (4) must be a multiple of n_kv_head (3)"));
  }
  rc.n_kv_head = 2;
  try {
    ring_attention op(*comms[0], rc);
    FAIL("accepted a zigzag split of 7 local tokens");
  } catch (const troupe::error& e) {
    std::printf("faults: ring_attention zigzag of 7 local tokens -> refused: %s\n", e.what());
    CHECK_THAT(e.what(), Catch::Contains("even local_seq"));
  }
}

}  // namespace troupe::models
