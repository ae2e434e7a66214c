// parallelize_llama: a tiny Llama with grouped-query attention (4 query, 2 key/value heads) split
// over 2 tensor-parallel shards (threads of a local group), with and without sequence parallelism,
// against the unsharded llama: one step's loss and every gradient shard (untied, and tied with
// attention biases), then training steps through the single-process trainer on both.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/causal_lm.hpp"
#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/testing.hpp"
#include "models/targets.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
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

void synthetic_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3) % 29);
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

// One forward and backward: the loss agrees to 1e-5 relative and each gradient shard equals the
// slice of the unsharded gradient to 1e-5 of its largest element (a wrong slice, a missing
// reduction or RoPE at the wrong positions is off by O(1)).
TEST_CASE("A tensor parallel Llama matches the unsharded loss and gradients", "[parallel]") {
  for (bool tied : {false, true}) {
    llama_config cfg = tiny(tied, /*bias=*/tied);
    batch_dims dims{2, 8};
    llama full(cfg, dims);
    full.init_weights(7);
    if (cfg.attention_bias) randomize_biases(full);
    auto ids = empty({2, 8}, dtype::i32);
    std::mt19937_64 g(8);
    for (std::int64_t i = 0; i < ids.numel(); ++i)
      ids.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(g() % cfg.vocab);
    auto targets = empty({2, 8}, dtype::i32);
    next_token_targets(ids, targets);
    full.memory().zero_grads();
    double loss = full.forward(ids, targets);
    full.backward();
    for (bool sp : {false, true}) {
      INFO("tied " << tied << " sp " << sp);
      std::vector<double> losses(2);
      std::vector<std::vector<float>> got(2), want(2);
      run_ranks(2, [&](int r, collective::communicator& comm) {
        auto m = parallelize_llama(full, dims, comm, sp);
        m->memory().zero_grads();
        losses[r] = m->forward(ids, targets);
        m->backward();
        got[r] = flat(m->memory().grads());
        m->load_from(full.slots(), /*from_grads=*/true, /*to_grads=*/false);
        want[r] = flat(m->memory().params());
      });
      for (int r = 0; r < 2; ++r) {
        INFO("rank " << r << " loss " << losses[r] << " vs " << loss);
        CHECK(std::abs(losses[r] - loss) <= 1e-5 * loss);
        double e = rel_err(got[r], want[r]);
        INFO("gradient relative error " << e);
        CHECK(e < 1e-5);
      }
    }
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
  c.recompute = true;
  CHECK_THROWS_WITH(tp_llama(c, {2, 8}, tp_group{&comm, false}), Contains("recompute"));
}

// The trainer runs unchanged on each shard (causal_lm_of<tp_llama>); clipping is off as in the
// GPT-2 test (the trainer's norm would be per shard). Losses track the single process within 1e-4
// relative over 8 AdamW steps.
TEST_CASE("Training a tiny Llama in tp2 for 8 steps matches the single process trainer",
          "[parallel]") {
  testing::check_tp2_training<llama, tp_llama>(tiny(), 8, synthetic_rows);
}

// The block-use hook (what ZeRO 3 gathers and releases by): every block's forward between its
// before/after_forward calls in order, then its backward between before/after_backward in reverse.
TEST_CASE("A tensor parallel Llama reports each block's use in order", "[parallel]") {
  const llama_config cfg = tiny();
  batch_dims dims{2, 8};
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
