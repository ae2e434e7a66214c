// parallelize_llama: a tiny Llama with grouped-query attention (4 query, 2 key/value heads) split
// over 2 tensor-parallel shards (threads of a local group), with and without sequence parallelism,
// against the unsharded llama: one step's loss and every gradient shard (untied, tied with
// attention biases, and Llama 3.x's MLP biases with rope_scaling), with and without activation
// recompute, then training steps through the single-process trainer on both, and dp2 x tp2 ZeRO 3
// with recompute under dp_trainer.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/causal_lm.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/model_producer.hpp"
#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/testing.hpp"
#include "models/targets.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
using namespace troupe::models::testing;

namespace {

llama_config tiny(bool tied = false, bool bias = false) {
  llama_config c;
  c.vocab = 32;
  c.max_seq = 8;
  c.dim = 32;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.hidden = 48;
  c.tie_embeddings = tied;
  c.attention_bias = bias;
  return c;
}

// Nonzero biases, so that a bias sliced or reduced wrongly shows in the loss.
void randomize_biases(llama& m) {
  std::mt19937_64 g(17);
  std::normal_distribution<float> n(0.0f, 0.05f);
  for (const auto& s : m.slots().slots())
    if (s.kind == slot_kind::param && s.name.ends_with(".bias"))
      for (std::int64_t i = 0; i < s.field->numel(); ++i) s.field->data_as<float>()[i] = n(g);
}

}  // namespace

// One forward and backward: the loss and each gradient shard are as accurate as the unsharded
// model's (its slice), against the unsharded model in f64 (check_shards; a wrong slice, a
// missing reduction or RoPE at the wrong positions is off by O(1)).
TEST_CASE("A tensor parallel Llama matches the unsharded loss and gradients", "[parallel]") {
  for (bool tied : {false, true}) {
    llama_config cfg = tiny(tied, /*bias=*/tied);
    batch_dims dims{2, 8};
    llama full(cfg, dims);
    full.init_weights(7);
    if (cfg.attention_bias) randomize_biases(full);
    auto exact = f64_twin(full, dims);
    const token_batch b = random_tokens(dims, cfg.vocab, 8);
    const whole_step<llama> w{full, one_step(full, b), *exact, one_step(*exact, b)};
    for (bool sp : {false, true}) {
      INFO("tied " << tied << " sp " << sp);
      check_shards(shard_steps(2, w, b,
                               [&](collective::communicator& comm) {
                                 return parallelize_llama(full, dims, comm, sp);
                               }),
                   w);
    }
  }
}

// Activation recompute on a shard, untied and tied with attention biases, with and without SP:
// every block's forward runs again before its backward, the collectives inside it too (see
// check_tp2_recompute). Three layers, so that a middle block's recompute is checked too.
// Llama 3.x checkpoints on shards: biases on the attention and on the MLP (gate_proj's and
// up_proj's sliced with their columns, down_proj's replicated and added once after the reduction:
// added on every shard, it would count tp times) with llama3 RoPE scaling (all three wavelength
// bands at head_dim 8, theta 100, original length 32) and with dynamic scaling that triggers
// (T = 8 > 4). The biases are drawn nonzero so that one added twice or sliced wrongly shows.
TEST_CASE("A tensor parallel Llama with MLP biases and rope_scaling matches the unsharded one",
          "[parallel]") {
  const rope_scaling llama3{.type = rope_scaling::kind::llama3,
                            .factor = 8.0,
                            .low_freq_factor = 1.0,
                            .high_freq_factor = 4.0,
                            .original_max_position = 32};
  const rope_scaling dynamic{
      .type = rope_scaling::kind::dynamic, .factor = 4.0, .original_max_position = 4};
  for (const rope_scaling& scaling : {llama3, dynamic}) {
    llama_config cfg = tiny(/*tied=*/false, /*bias=*/true);
    cfg.mlp_bias = true;
    cfg.rope_theta = 100.0;
    cfg.rope_scale = scaling;
    batch_dims dims{2, 8};
    llama full(cfg, dims);
    full.init_weights(7);
    randomize_biases(full);
    std::int64_t mlp_biases = 0;
    for (const auto& s : full.slots().slots())
      mlp_biases += s.name.ends_with("_proj.bias") && s.name.find(".mlp.") != std::string::npos;
    REQUIRE(mlp_biases == 3 * cfg.n_layer);
    auto exact = f64_twin(full, dims);
    const token_batch b = random_tokens(dims, cfg.vocab, 8);
    const whole_step<llama> w{full, one_step(full, b), *exact, one_step(*exact, b)};
    for (bool sp : {false, true}) {
      INFO(rope_type_name(scaling.type) << " sp " << sp);
      check_shards(shard_steps(2, w, b,
                               [&](collective::communicator& comm) {
                                 return parallelize_llama(full, dims, comm, sp);
                               }),
                   w);
    }
  }
}

TEST_CASE("A tensor parallel Llama with activation recompute gives the same gradients",
          "[parallel]") {
  for (bool tied : {false, true}) {
    INFO("tied " << tied);
    llama_config cfg = tiny(tied, /*bias=*/tied);
    cfg.n_layer = 3;
    check_tp2_recompute<llama, tp_llama>(cfg, {2, 8},
                                         tied ? randomize_biases : std::function<void(llama&)>{});
  }
}

TEST_CASE("A tensor parallel Llama refuses what it cannot split naming the field", "[parallel]") {
  using Catch::Matchers::Contains;
  auto comms = collective::make_local_group(4);  // constructors only: no collective runs
  collective::communicator& comm = *comms[0];
  // 2 key/value heads cannot be split over 4 shards.
  CHECK_THROWS_WITH(tp_llama(tiny(), {2, 8}, tp_group{&comm, false}),
                    Contains("parallel.tp = 4") && Contains("n_kv_head"));
  llama_config c = tiny();
  c.n_kv_head = 4;
  c.hidden = 50;
  CHECK_THROWS_WITH(tp_llama(c, {2, 8}, tp_group{&comm, false}),
                    Contains("parallel.tp = 4") && Contains("intermediate_size"));
  c.hidden = 48;
  CHECK_THROWS_WITH(tp_llama(c, {2, 6}, tp_group{&comm, true}), Contains("sequence length"));
}

// The trainer runs unchanged on each shard (causal_lm_of<tp_llama>); clipping is off as in the
// GPT-2 test (the trainer's norm would be per shard). Losses track the single process over 8 AdamW
// steps as accurately as it tracks the same run in f64 (check_tp2_training).
TEST_CASE("Training a tiny Llama in tp2 for 8 steps matches the single process trainer",
          "[parallel]") {
  testing::check_tp2_training<llama, tp_llama>(tiny(), 8, synthetic_rows);
}

// The block-use hook (what ZeRO 3 gathers and releases by): every block's forward between its
// before/after_forward calls in order, then its backward between before/after_backward in reverse;
// with recompute the same calls (the recomputed forward falls inside the backward pair).
TEST_CASE("A tensor parallel Llama reports each block's use in order", "[parallel]") {
  batch_dims dims{2, 8};
  for (bool recompute : {false, true}) {
    INFO("recompute " << recompute);
    llama_config cfg = tiny();
    cfg.recompute = recompute;
    std::vector<std::vector<std::pair<std::int64_t, block_use>>> seen(2);
    run_ranks(2, [&](int r, collective::communicator& comm) {
      causal_lm_of<tp_llama> m(cfg, dims, tp_group{&comm, false});
      m.init_weights(3);
      REQUIRE(m.set_block_use_hook([&, r](std::int64_t i, block_use u) {
        seen[r].push_back({i, u});
      }));
      auto ids = empty({2, 8}, dtype::i32), targets = empty({2, 8}, dtype::i32);
      for (std::int64_t i = 0; i < ids.numel(); ++i)
        ids.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(i * 7 % cfg.vocab);
      next_token_targets(ids, targets);
      m.memory().zero_grads();
      m.forward(ids, targets);
      m.backward(1.0);
    });
    std::vector<std::pair<std::int64_t, block_use>> want;
    for (std::int64_t i = 0; i < cfg.n_layer; ++i)
      for (auto u : {block_use::before_forward, block_use::after_forward}) want.push_back({i, u});
    for (std::int64_t i = cfg.n_layer - 1; i >= 0; --i)
      for (auto u : {block_use::before_backward, block_use::after_backward}) want.push_back({i, u});
    CHECK(seen[0] == want);
    CHECK(seen[1] == want);
  }
}

// ZeRO 3 over Llama shards that recompute: dp2 x tp2 (4 threads; world rank = 2 dp + tp), each
// block gathered when its use begins (prefetch 0) and released (poisoned with NaN) after it, so a
// recomputed forward outside its block's backward pair reads NaN weights and turns the loss and the
// norm into NaN. Clip 0.05 is below every step's norm. Losses and norms as accurate as the
// single-process trainer's without recompute, against the same run in f64 (tests/rounding.hpp).
TEST_CASE("ZeRO 3 over recomputing tensor parallel Llama shards matches the single process",
          "[parallel]") {
  train_config c;
  c.steps = 4;
  c.batch = 4;
  c.seq = 8;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.05;
  std::vector<double> want_loss, want_norm, exact_loss, exact_norm;
  for (bool f64 : {false, true}) {
    causal_lm_of<llama> whole(tiny(), batch_dims{c.batch, c.seq}, f64 ? dtype::f64 : dtype::f32);
    whole.init_weights(3);
    train_config cw = c;
    if (f64) cw.precision = "f64";
    trainer t(whole, cw);
    for (int s = 0; s < c.steps; ++s) {
      auto res = t.step(synthetic_rows);
      (f64 ? exact_loss : want_loss).push_back(res.loss);
      (f64 ? exact_norm : want_norm).push_back(res.grad_norm);
    }
  }
  c.plan.dp = 2;
  c.plan.tp = 2;
  c.plan.zero = 3;
  llama_config cfg = tiny();
  cfg.recompute = true;
  // dps[tp][dp], tps[dp][tp]
  std::vector<std::vector<std::unique_ptr<collective::communicator>>> dps, tps;
  std::vector<collective::communicator*> all;
  for (int k = 0; k < 2; ++k) {
    dps.push_back(collective::make_local_group(2));
    tps.push_back(collective::make_local_group(2));
    for (int j = 0; j < 2; ++j) all.insert(all.end(), {dps[k][j].get(), tps[k][j].get()});
  }
  std::vector<std::vector<step_result>> got(4);
  run_threads(
      4,
      [&](int r) {
        const int dp = r / 2, tp = r % 2;
        const batch_dims dims{dp_trainer::microbatch_rows(c), c.seq};
        causal_lm_of<tp_llama> shard(cfg, dims, tp_group{tps[dp][tp].get(), false});
        shard.init_weights(3);
        model_producer piece(shard, *tps[dp][tp]);
        dp_trainer t(piece, c, *dps[tp][dp],
                     {.bucket_bytes = 4 * 1009, .poison_released = true, .prefetch = 0});
        for (int s = 0; s < c.steps; ++s) got[r].push_back(t.step(synthetic_rows));
      },
      all);
  for (int s = 0; s < c.steps; ++s) CHECK(want_norm[s] > 2 * c.clip);
  for (int r = 0; r < 4; ++r) {
    std::vector<double> loss, norm;
    for (const auto& g : got[r]) loss.push_back(g.loss), norm.push_back(g.grad_norm);
    auto vl = tests::as_accurate_as(loss, want_loss, exact_loss, tests::trajectory_k);
    auto vn = tests::as_accurate_as(norm, want_norm, exact_norm, tests::trajectory_k);
    INFO("world rank " << r << " losses: " << vl.str() << "; norms: " << vn.str());
    CHECK(vl.ok());
    CHECK(vn.ok());
  }
}
