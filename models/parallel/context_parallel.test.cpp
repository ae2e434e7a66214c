// Context parallelism (context_parallel.hpp), Ulysses and ring, against the whole model and the
// single-process trainer: cp ranks as threads of one process (collective/local), each holding T/cp
// positions of every sample (Ulysses: consecutive; ring: two zigzag chunks), must give the whole
// model's loss and gradients (one step) and the single process's losses, gradient norms and weights
// (training, also dp2 x cp2), at the same tokens per step.
#include <catch2/catch.hpp>

#include <array>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/layers/sequence_split.hpp"
#include "models/parallel/context_parallel.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/exact_run.hpp"
#include "models/parallel/testing.hpp"
#include "models/token_objective.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::models::parallel::cp_piece;
using troupe::models::parallel::dp_trainer;
using troupe::models::parallel::microbatch_data;
using troupe::models::parallel::ulysses_exchange;
using troupe::models::parallel::ulysses_pool;
using troupe::scheduler::cp_mode_kind;
namespace t = troupe::models::testing;

namespace {

hf::model_config tiny_model(bool llama) {
  return named_model_config(llama ? "llama-tiny" : "gpt2-demo", 29).value();
}

std::vector<float> host_params(causal_lm& m) {
  const tensor& p = m.memory().params();
  return {p.data_as<float>(), p.data_as<float>() + p.numel()};
}

// Rows of `seq` tokens from a fixed pseudo-random stream, a pure function of the draw.
void rows_of(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3 + (i * draw) % 5) % 29);
}

// The value the exchange test puts at (sample b, global position p, global head h, element e).
float code(std::int64_t b, std::int64_t p, std::int64_t h, std::int64_t e) {
  return static_cast<float>(b * 100000 + p * 1000 + h * 10 + e);
}

}  // namespace

TEST_CASE(
    "The Ulysses exchange gives each rank every position of its heads of each section and "
    "back",
    "[parallel][cp]") {
  // 2 samples, 6 positions over 2 ranks, a fused q | k | v of 4 + 2 + 2 heads of 3 elements.
  const int cp = 2;
  const std::int64_t b = 2, tl = 3, d = 3;
  const std::array<std::int64_t, 3> sections{4, 2, 2};
  const std::int64_t h = 8, hl = h / cp;
  std::vector<std::vector<float>> xs(cp), ys(cp), backs(cp);
  t::run_ranks(cp, [&](int r, collective::communicator& comm) {
    ulysses_exchange ex(comm, std::make_shared<ulysses_pool>());
    owned_tensor x = empty({b, tl, h, d}), y = empty({b, tl * cp, hl, d}),
                 back = empty({b, tl, h, d});
    for (std::int64_t i = 0; i < b; ++i)
      for (std::int64_t p = 0; p < tl; ++p)
        for (std::int64_t k = 0; k < h; ++k)
          for (std::int64_t e = 0; e < d; ++e)
            x.data_as<float>()[((i * tl + p) * h + k) * d + e] = code(i, r * tl + p, k, e);
    ex.to_heads(x, y, sections);
    ex.to_sequence(y, back, sections);
    xs[r] = t::flat(x);
    ys[r] = t::flat(y);
    backs[r] = t::flat(back);
  });
  // (Checked here, not on the rank threads: Catch's assertions are not thread-safe.)
  for (int r = 0; r < cp; ++r) {
    // Rank r's local heads: q heads 2r, 2r+1; k head 4 + r; v head 6 + r.
    const std::int64_t mine[] = {2 * r, 2 * r + 1, 4 + r, 6 + r};
    for (std::int64_t i = 0; i < b; ++i)
      for (std::int64_t p = 0; p < tl * cp; ++p)
        for (std::int64_t k = 0; k < hl; ++k)
          for (std::int64_t e = 0; e < d; ++e) {
            INFO("rank " << r << " sample " << i << " position " << p << " local head " << k);
            REQUIRE(ys[r][static_cast<std::size_t>(((i * tl * cp + p) * hl + k) * d + e)] ==
                    code(i, p, mine[k], e));
          }
    CHECK(backs[r] == xs[r]);  // to_sequence undoes to_heads, bit for bit (copies only)
  }
}

namespace {

// One step of `cp` ranks in `mode` against the whole model (f32) and its f64 twin.
void check_one_step(cp_mode_kind mode, int cp) {
  for (bool llama : {false, true}) {
    INFO((llama ? "llama-tiny (4 heads, 2 kv heads)" : "gpt2-demo")
         << " " << scheduler::name(mode) << " cp " << cp);
    const batch_dims dims{2, 8};
    auto whole = make_causal_lm(tiny_model(llama), dims);
    whole->init_weights(7);
    auto exact = make_causal_lm(tiny_model(llama), dims, dtype::f64);
    exact->init_weights(7);  // the f32 weights exactly
    const t::token_batch tb = t::random_tokens(dims, 29, 9);
    auto step = [&](causal_lm& m) {
      m.memory().zero_grads();
      const double loss = m.forward(tb.ids, tb.targets);
      m.backward();
      return loss;
    };
    const double ref_loss = step(*whole), exact_loss = step(*exact);
    std::vector<double> share(cp);
    std::vector<std::vector<float>> grads(cp);
    t::run_ranks(cp, [&](int r, collective::communicator& comm) {
      cp_piece piece(tiny_model(llama), dims.batch, dims.seq, comm, dtype::f32, false, mode);
      t::copy_params_by_name(whole->slots(), piece.slots());
      piece.memory().zero_grads();
      share[r] = piece.forward_backward(1, [&](int) {
        return microbatch_data{tb.ids, tb.targets, 1.0};
      });
      grads[r] = t::flat(piece.memory().grads());
    });
    // The ranks' shares and gradients add up to the whole sequence's (the engine's reduction):
    // the same terms as the whole model's, summed in another order (Ulysses: the attention over
    // all positions is the same computation on each head; ring: each row's softmax is merged from
    // the ring's blocks by their log-sum-exps; the weight gradients are split over positions), so
    // as accurate as the whole model against its f64 twin (tests/rounding.hpp).
    std::vector<float> sum(grads[0].size(), 0.0f);
    double loss = 0;
    for (int r = 0; r < cp; ++r) {
      loss += share[r];
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] += grads[r][i];
    }
    const auto vl = tests::as_accurate_as(std::vector<double>{loss}, std::vector<double>{ref_loss},
                                          std::vector<double>{exact_loss});
    const auto vg = tests::as_accurate_as(sum, t::flat(whole->memory().grads()),
                                          t::as_f64(exact->memory().grads()));
    INFO("loss " << loss << " vs " << ref_loss << ": " << vl.str());
    INFO("gradients: " << vg.str());
    CHECK(vl.ok());
    CHECK(vg.ok());
  }
}

}  // namespace

TEST_CASE(
    "One step of cp2 and cp4 ranks gives the whole model's loss and gradients for GPT-2 and "
    "grouped-query Llama",
    "[parallel][cp]") {
  // cp4 over llama-tiny's 2 kv heads: each kv head is repeated to two ranks (and its gradient
  // summed back from them).
  check_one_step(cp_mode_kind::ulysses, 2);
  check_one_step(cp_mode_kind::ulysses, 4);
}

TEST_CASE(
    "One step of ring cp2 and cp4 ranks gives the whole model's loss and gradients for GPT-2 "
    "and grouped-query Llama",
    "[parallel][cp]") {
  // cp4 over llama-tiny's 2 kv heads: the ring needs no head split. seq 8 over 4 ranks: zigzag
  // chunks of one token, positions {r, 7 - r}.
  check_one_step(cp_mode_kind::ring, 2);
  check_one_step(cp_mode_kind::ring, 4);
}

namespace {

struct run_result {
  std::vector<step_result> steps;
  std::vector<float> params;
};

train_config tiny_run(std::int64_t batch) {
  train_config c;
  c.steps = 10;
  c.batch = batch;
  c.seq = 8;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.5;  // the first steps' norms exceed it, so clipping is exercised
  c.eps = 1e-6;  // as data_parallel.test.cpp: keeps AdamW's magnified rounding noise small
  return c;
}

// dp x cp ranks as threads: group `all` (dp x cp, cp fastest) for the engine, a group of cp per
// data-parallel rank for the exchanges. Every rank's result.
// recompute: each block's forward again in backward (its all-to-alls included).
std::vector<run_result> context_parallel(bool llama, train_config c, int dp, int cp,
                                         bool recompute) {
  c.plan.dp = dp;
  c.plan.cp = cp;
  auto all = collective::make_local_group(dp * cp);
  std::vector<std::vector<std::unique_ptr<collective::communicator>>> cps;
  std::vector<collective::communicator*> comms;
  for (auto& a : all) comms.push_back(a.get());
  for (int i = 0; i < dp; ++i) {
    cps.push_back(collective::make_local_group(cp));
    for (auto& g : cps.back()) comms.push_back(g.get());
  }
  std::vector<run_result> out(dp * cp);
  t::run_threads(
      dp * cp,
      [&](int r) {
        cp_piece piece(tiny_model(llama), dp_trainer::microbatch_rows(c), c.seq,
                       *cps[r / cp][r % cp], dtype::f32, recompute, c.plan.cp_mode);
        piece.model().init_weights(5);
        dp_trainer tr(piece, c, *all[r]);
        for (int s = 0; s < c.steps; ++s) out[r].steps.push_back(tr.step(rows_of));
        tr.gather_full_parameters();  // ZeRO 3: the piece holds only what a step gathered
        out[r].params = host_params(piece.model());
      },
      comms);
  return out;
}

}  // namespace

namespace {

// (dp, cp, ZeRO stage, recompute) rows of `mode` against the single process and the f64 run.
void check_training(cp_mode_kind mode, std::initializer_list<std::array<int, 4>> rows) {
  for (bool llama : {false, true}) {
    const train_config c = tiny_run(4);
    run_result ref;
    {
      auto m = make_causal_lm(tiny_model(llama), {c.batch, c.seq});
      m->init_weights(5);
      trainer tr(*m, c);
      for (int s = 0; s < c.steps; ++s) ref.steps.push_back(tr.step(rows_of));
      ref.params = host_params(*m);
    }
    auto x64 = make_causal_lm(tiny_model(llama), {c.batch, c.seq}, dtype::f64);
    x64->init_weights(5);
    const t::exact_run exact = t::exact_training(*x64, c, rows_of);
    CHECK(ref.steps[0].grad_norm > c.clip);
    // (dp, cp, ZeRO stage, recompute): ZeRO 2 and 3 shard over the dp x cp ranks; ZeRO 3 gathers
    // each block around its uses through the piece's block use hook.
    for (auto [dp, cp, zero, recompute] : rows) {
      INFO((llama ? "llama-tiny" : "gpt2-demo")
           << " " << scheduler::name(mode) << " dp " << dp << " cp " << cp << " zero " << zero
           << " recompute " << recompute);
      train_config pc = c;
      pc.plan.zero = zero;
      pc.plan.cp_mode = mode;
      const auto runs = context_parallel(llama, pc, dp, cp, recompute != 0);
      for (const auto& run : runs) {
        for (int s = 0; s < c.steps; ++s) {
          CHECK(run.steps[s].lr == ref.steps[s].lr);
          CHECK(run.steps[s].tokens == ref.steps[s].tokens);
        }
        // Every rank holds the same weights, bit for bit (the reduced gradients and the gathered
        // parameters are the same bytes on every rank) ...
        CHECK(run.params == runs[0].params);
        // ... and the losses, norms and weights are the single process's up to f32 summation
        // order, which AdamW magnifies alike in both runs: as accurate as the single process
        // against the f64 run (exact_run.hpp).
        t::check_run_as_accurate(run, ref, exact);
      }
    }
  }
}

}  // namespace

TEST_CASE(
    "Ulysses cp2, cp4 and dp2 x cp2 training equal the single process trainer for GPT-2 and "
    "grouped-query Llama",
    "[parallel][cp]") {
  // cp4: more ranks than llama-tiny's 2 kv heads (repeated kv heads), with and without recompute.
  check_training(cp_mode_kind::ulysses,
                 {std::array{1, 2, 0, 0}, std::array{1, 2, 0, 1}, std::array{1, 4, 0, 0},
                  std::array{1, 4, 0, 1}, std::array{2, 2, 0, 0}, std::array{2, 2, 2, 0},
                  std::array{2, 2, 3, 0}});
}

TEST_CASE(
    "Ring cp2, cp4 and dp2 x cp2 training equal the single process trainer for GPT-2 and "
    "grouped-query Llama",
    "[parallel][cp]") {
  // cp4: four ranks, one-token zigzag chunks, more ranks than llama-tiny's kv heads.
  check_training(cp_mode_kind::ring,
                 {std::array{1, 2, 0, 0}, std::array{1, 2, 0, 1}, std::array{1, 4, 0, 0},
                  std::array{2, 2, 0, 0}, std::array{2, 2, 3, 0}});
}

TEST_CASE(
    "Ulysses over more ranks than heads and a mixture of experts are refused naming "
    "parallel.cp",
    "[parallel][cp][faults]") {
  // llama-tiny has 4 heads: 8 ranks would hold half a head each.
  std::string said;
  try {
    t::run_ranks(8, [&](int, collective::communicator& comm) {
      cp_piece piece(tiny_model(true), 1, 8, comm);
    });
  } catch (const std::exception& e) {
    said = e.what();
  }
  std::printf("faults: Ulysses cp8 over 4 heads -> refused: %s\n", said.c_str());
  CHECK_THAT(said, Catch::Contains("parallel.cp = 8") && Catch::Contains("heads (4)"));
  said.clear();
  try {
    t::run_ranks(2, [&](int, collective::communicator& comm) {
      cp_piece piece(named_model_config("mixtral-tiny", 29).value(), 1, 8, comm);
    });
  } catch (const std::exception& e) {
    said = e.what();
  }
  std::printf("faults: Ulysses cp2 of a mixture of experts -> refused: %s\n", said.c_str());
  CHECK_THAT(said, Catch::Contains("parallel.cp = 2") && Catch::Contains("mixture-of-experts"));
}

TEST_CASE("Ring over a seq that does not split into 2 cp chunks is refused",
          "[parallel][cp][faults]") {
  std::string said;
  try {
    t::run_ranks(2, [&](int, collective::communicator& comm) {
      cp_piece piece(tiny_model(false), 1, 6, comm, dtype::f32, false, cp_mode_kind::ring);
    });
  } catch (const std::exception& e) {
    said = e.what();
  }
  std::printf("faults: ring cp2 of seq 6 -> refused: %s\n", said.c_str());
  CHECK_THAT(said, Catch::Contains("2 x parallel.cp = 4") && Catch::Contains("train.seq = 6"));
}

TEST_CASE("A cp rank's columns refuse packed rows and token objectives instead of dropping them",
          "[parallel][cp][faults]") {
  // cp_columns cuts ids and targets only: a post-training microbatch's segments, positions or
  // per-token objective would reach the piece without them, so each is refused naming
  // parallel.cp; a plain microbatch of the same rows is cut.
  constexpr std::int64_t seq = 8;
  troupe::models::parallel::cp_columns columns(seq,
                                               sequence_pieces(seq, 2, 1, sequence_layout::zigzag));
  std::vector<std::int32_t> ids(2 * seq, 3), targets(2 * seq, 4), seg(2 * seq, 0);
  const auto rows = [&](std::vector<std::int32_t>& v) {
    return tensor(v.data(), v.size() * 4, dtype::i32, {2, seq});
  };
  const microbatch_data plain(rows(ids), rows(targets), 1.0);
  CHECK(columns(plain, 0).ids.size(1) == seq / 2);
  for (int which = 0; which < 3; ++which) {
    microbatch_data mb(rows(ids), rows(targets), 1.0);
    if (which == 0) mb.segments = rows(seg);
    if (which == 1) mb.positions = rows(seg);
    if (which == 2) mb.objective = [](std::span<const double>) { return token_loss{}; };
    std::string said;
    try {
      (void)columns(mb, 0);
    } catch (const std::exception& e) {
      said = e.what();
    }
    std::printf("faults: cp columns of a post-training microbatch (%d) -> refused: %s\n", which,
                said.c_str());
    CHECK_THAT(said, Catch::Contains("parallel.cp") && Catch::Contains("token objective"));
  }
}
