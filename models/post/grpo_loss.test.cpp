// GRPO: the group advantages, loss, metrics and the gradient into the logits against a PyTorch
// reference written from TRL's formulas (tests/fixtures/post/grpo_losses.json,
// scripts/reference/make_grpo_fixture.py: float64 with autograd); the micro-batch's gradient
// through a tiny Llama against central differences of the loss; batched group sampling.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "models/generation.hpp"
#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "models/post/central_differences.test.hpp"
#include "models/post/grpo_step.hpp"
#include "models/post/rollout.hpp"
#include "models/post/token_logprob.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

nlohmann::json fixture() {
  std::ifstream in(std::filesystem::path(TROUPE_SOURCE_DIR) /
                   "tests/fixtures/post/grpo_losses.json");
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

llama_config tiny() {
  return {.vocab = 23,
          .dim = 16,
          .n_layer = 2,
          .n_head = 4,
          .n_kv_head = 2,
          .hidden = 24,
          .max_seq = 16};
}

}  // namespace

TEST_CASE("GRPO advantages, loss and logit gradients equal TRL's formulas in PyTorch", "[cpu]") {
  int seen = 0;
  for (const auto& c : fixture()) {
    ++seen;
    INFO("case " << c["seed"].get<int>());
    const std::int64_t rows = c["rows"], seq = c["seq"], vocab = c["vocab"];
    const grpo_options opt{.epsilon = c["epsilon"], .beta = c["beta"]};
    auto rewards = c["rewards"].get<std::vector<double>>();
    auto logits_v = c["logits"].get<std::vector<double>>();
    auto targets_v = c["targets"].get<std::vector<std::int32_t>>();
    const auto old = c["old_logp"].get<std::vector<double>>();
    const auto ref = c["ref_logp"].get<std::vector<double>>();
    const auto want_logp = c["logp"].get<std::vector<double>>();
    const auto want_d = c["dlogits"].get<std::vector<double>>();

    // Both sides evaluate the same closed forms in f64 on values of size <= ~10 (sums of <= 6
    // terms; logsumexp over <= 7): they agree to a few ulps, so 1e-12 absolute is far above
    // rounding and far below a mistake (a wrong sign, the biased std, a token mean instead of a
    // sequence mean, a missing beta or clip change values by 1e-3 and more).
    const auto adv = group_advantages(rewards, c["group"], c["scale_rewards"]);
    const auto want_adv = c["advantages"].get<std::vector<double>>();
    REQUIRE(adv.size() == want_adv.size());
    for (std::size_t i = 0; i < adv.size(); ++i) CHECK(adv[i] == Approx(want_adv[i]).margin(1e-12));

    tensor logits(logits_v.data(), logits_v.size() * 8, dtype::f64, {rows * seq, vocab});
    tensor targets(targets_v.data(), targets_v.size() * 4, dtype::i32, {rows * seq});
    owned_tensor losses = empty({rows * seq}, dtype::f64);
    const auto logp = token_logprobs(logits, targets, losses);
    for (std::size_t i = 0; i < logp.size(); ++i)
      CHECK(logp[i] == Approx(want_logp[i]).margin(1e-12));

    std::vector<std::uint8_t> mask(targets_v.size());
    for (std::size_t i = 0; i < mask.size(); ++i) mask[i] = targets_v[i] != -100;
    const grpo_result r = grpo_loss(logp, old, ref, mask, adv, opt);
    CHECK(r.loss == Approx(c["loss"].get<double>()).margin(1e-12));
    CHECK(r.kl == Approx(c["kl"].get<double>()).margin(1e-12));
    CHECK(r.clip_ratio == Approx(c["clip_ratio"].get<double>()).margin(1e-12));
    CHECK(r.clip_ratio > 0);  // the case reaches the clipped branch

    owned_tensor dlogits = empty({rows * seq, vocab}, dtype::f64);
    token_logprobs_backward(logits, targets, r.dlogp, losses, dlogits);
    const double* d = dlogits.data_as<double>();
    double largest = 0;
    for (std::size_t i = 0; i < want_d.size(); ++i) {
      INFO("dlogits " << i);
      CHECK(d[i] == Approx(want_d[i]).margin(1e-12));
      largest = std::max(largest, std::abs(want_d[i]));
    }
    CHECK(largest > 1e-3);
  }
  CHECK(seen == 3);
}

TEST_CASE("a GRPO micro-batch backpropagates the gradient of the GRPO loss", "[cpu]") {
  for (const double beta : {0.04, 0.0}) {
    INFO("beta " << beta);
    causal_lm_of<llama> policy(tiny(), batch_dims{4, 8}, dtype::f64);
    causal_lm_of<llama> other(tiny(), batch_dims{4, 8}, dtype::f64);
    policy.init_weights(4);
    other.init_weights(3);
    // Two groups of two rows: a 3-token prompt, completions of 2 to 5 tokens.
    auto b = std::make_shared<grpo_batch>();
    b->rows = 4;
    b->seq = 8;
    testing::rng g(5);
    for (std::int64_t r = 0; r < 4; ++r) {
      const std::int64_t len = 2 + r;
      for (std::int64_t i = 0; i < 8; ++i) {
        b->ids.push_back(static_cast<std::int32_t>(g.integer(0, 22)));
        b->targets.push_back(i >= 2 && i < 2 + len && i + 1 < 8 ? b->ids.back() : -100);
      }
    }
    for (std::int64_t r = 0; r < 4; ++r)  // targets are the next ids
      for (std::int64_t i = 0; i + 1 < 8; ++i)
        if (b->targets[r * 8 + i] != -100) b->targets[r * 8 + i] = b->ids[r * 8 + i + 1];
    tensor ids(b->ids.data(), b->ids.size() * 4, dtype::i32, {4, 8});
    tensor targets(b->targets.data(), b->targets.size() * 4, dtype::i32, {4, 8});
    // old: another model's log-probabilities, so ratios are far from 1 and some are clipped.
    b->old_logp = token_logprobs_of(other, ids, targets);
    b->ref_logp = token_logprobs_of(other, ids, targets);
    for (auto& x : b->ref_logp) x *= 0.7;
    b->advantages = group_advantages(std::vector<double>{1.0, 0.0, 0.5, 1.0}, 2);
    const grpo_options opt{.epsilon = 0.2, .beta = beta};

    policy.memory().zero_grads();
    grpo_result seen;
    const double loss =
        grpo_micro_batch(b, opt, [&](const grpo_result& r) { seen = r; })(policy, 0, 1.0);
    CHECK(loss == seen.loss);
    const tensor& grad = policy.memory().grads();
    const tensor& p = policy.memory().params();
    auto loss_at = [&]() { return grpo_forward(policy, *b, opt).loss; };
    CHECK(loss_at() == Approx(loss).epsilon(1e-14));
    // f64 central differences (central_differences.test.hpp): far below a token misweighted or
    // left out. The clip's kinks are where the loss has no derivative: a parameter whose +-h
    // crosses one shows as a mismatch, which is unlikely at h = 1e-5 (none seen).
    testing::rng pick(2);
    std::vector<std::int64_t> at;
    for (int k = 0; k < 40; ++k) at.push_back(pick.integer(0, p.numel() - 1));
    testing::check_central_differences(p, grad, at, loss_at);
  }
}

TEST_CASE("group sampling decodes all rows together as each would alone", "[cpu]") {
  causal_lm_of<llama> m(tiny(), batch_dims{6, 16}, dtype::f64);
  m.init_weights(7);
  const std::vector<std::int32_t> prompts{1, 2, 3, 4, 5, 6, 7, 8, 9};  // 3 prompts of 3
  rollout_options opt{.group = 2, .max_new = 5, .sampling = {.greedy = true}, .eos = 11};
  const rollout_rows r = sample_completions(m, prompts, 3, opt);
  REQUIRE(r.rows == 6);
  REQUIRE(r.seq == 8);
  for (std::int64_t row = 0; row < 6; ++row) {
    INFO("row " << row);
    // Greedy: each row's completion is what generate() gives its prompt alone (f64: the batched
    // and single decodes round alike enough that the argmax agrees).
    token_sampler greedy({.greedy = true});
    const auto alone = generate(
        m, std::span(prompts).subspan(static_cast<std::size_t>(row / 2) * 3, 3), 5, greedy, 11);
    const auto got = r.completion(row);
    CHECK(std::vector<std::int32_t>(got.begin(), got.end()) == alone);
    // Targets: the completion's tokens at the positions before them; nothing else.
    for (std::int64_t i = 0; i < 8; ++i) {
      const std::int32_t want = i >= 2 && i < 2 + r.lengths[static_cast<std::size_t>(row)]
                                    ? r.ids[static_cast<std::size_t>(row * 8 + i + 1)]
                                    : -100;
      CHECK(r.targets[static_cast<std::size_t>(row * 8 + i)] == want);
    }
  }
  // Sampling at temperature 1: a seed fixes the batch; rows of one group differ.
  opt.sampling = {.temperature = 1.0};
  opt.seed = 3;
  const rollout_rows a = sample_completions(m, prompts, 3, opt);
  const rollout_rows b = sample_completions(m, prompts, 3, opt);
  CHECK(a.ids == b.ids);
  bool differ = false;
  for (std::int64_t row = 0; row < 6; row += 2)
    differ = differ || !std::ranges::equal(a.completion(row), a.completion(row + 1));
  CHECK(differ);
}

TEST_CASE("GRPO steps raise the reward of sampled completions", "[cpu]") {
  // Sample, reward (the share of token 5 in the completion), group advantages, one trainer step;
  // again. A random tiny Llama samples token 5 about 1 time in 23; GRPO must make it more likely.
  causal_lm_of<llama> m(tiny(), batch_dims{32, 8}, dtype::f32);
  m.init_weights(11);
  train_config tc;
  tc.lr = tc.min_lr = 1e-2;
  tc.warmup = 0;
  tc.steps = 1000;
  tc.weight_decay = 0;
  tc.batch = 32;
  tc.seq = 8;
  trainer t(m, tc);
  auto b = std::make_shared<grpo_batch>();
  const std::vector<std::int32_t> prompts{1, 2, 3, 4, 5, 6, 7, 8};  // 4 prompts of 2
  std::vector<double> means;
  for (int it = 0; it < 20; ++it) {
    const rollout_rows r = sample_completions(
        m, prompts, 2,
        {.group = 8, .max_new = 6, .sampling = {}, .seed = static_cast<std::uint64_t>(it)});
    std::vector<double> rewards;
    for (std::int64_t row = 0; row < r.rows; ++row) {
      const auto c = r.completion(row);
      rewards.push_back(static_cast<double>(std::ranges::count(c, 5)) /
                        static_cast<double>(c.size()));
    }
    double mean = 0;
    for (double x : rewards) mean += x / static_cast<double>(rewards.size());
    means.push_back(mean);
    b->rows = r.rows;
    b->seq = r.seq;
    b->ids = r.ids;
    b->targets = r.targets;
    tensor ids(b->ids.data(), b->ids.size() * 4, dtype::i32, {r.rows, r.seq});
    tensor tg(b->targets.data(), b->targets.size() * 4, dtype::i32, {r.rows, r.seq});
    b->old_logp = token_logprobs_of(m, ids, tg);
    b->ref_logp.clear();
    b->advantages = group_advantages(rewards, 8);
    t.step(grpo_micro_batch(b, {.epsilon = 0.2, .beta = 0.0}));
  }
  INFO("first " << means.front() << " last " << means.back());
  CHECK(means.back() > means.front() + 0.2);
}
