// PPO: per-token rewards, GAE, whitening, the clipped policy and value losses, their gradients and
// the entropy against a PyTorch float64 reference written from TRL's formulas
// (tests/fixtures/post/ppo_losses.json, scripts/reference/make_ppo_fixture.py); the policy's and
// the critic's micro-batches through a tiny Llama against central differences of their losses.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>

#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "models/post/central_differences.test.hpp"
#include "models/post/ppo_advantages.hpp"
#include "models/post/ppo_step.hpp"
#include "models/post/token_logprob.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

nlohmann::json fixture() {
  std::ifstream in(std::filesystem::path(TROUPE_SOURCE_DIR) /
                   "tests/fixtures/post/ppo_losses.json");
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

// Both sides evaluate the same closed forms in f64 on values of size <= ~10 (sums over <= 40
// tokens, one square root, exp and logsumexp over <= 7): they agree to a few ulps of those sizes,
// so 1e-12 is far above rounding and far below a mistake (a token mean instead of a sequence mean,
// the biased variance, the score on the wrong token, a missing gamma or lambda, the wrong clip
// branch change values by 1e-3 and more).
void check_close(const std::vector<double>& got, const std::vector<double>& want,
                 const char* what) {
  REQUIRE(got.size() == want.size());
  double largest = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    INFO(what << " " << i);
    CHECK(got[i] == Approx(want[i]).margin(1e-12));
    largest = std::max(largest, std::abs(want[i]));
  }
  CHECK(largest > 1e-3);  // the comparison saw real values
}

// TRL's rows ([B, L], responses first) behind a prompt of `prefix` positions off the mask, as
// this repository lays sampled rows out ([B, prefix + L]).
std::vector<double> shifted(const std::vector<double>& x, std::int64_t rows, std::int64_t prefix) {
  const std::size_t l = x.size() / static_cast<std::size_t>(rows);
  std::vector<double> out;
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    out.insert(out.end(), static_cast<std::size_t>(prefix), 0.0);
    out.insert(out.end(), x.begin() + static_cast<std::ptrdiff_t>(r * l),
               x.begin() + static_cast<std::ptrdiff_t>((r + 1) * l));
  }
  return out;
}

std::vector<double> unshifted(const std::vector<double>& x, std::int64_t rows,
                              std::int64_t prefix) {
  const std::size_t t = x.size() / static_cast<std::size_t>(rows);
  std::vector<double> out;
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    for (std::size_t k = 0; k < static_cast<std::size_t>(prefix); ++k)
      CHECK(x[r * t + k] == 0.0);  // nothing leaks onto the prompt
    out.insert(out.end(), x.begin() + static_cast<std::ptrdiff_t>(r * t) + prefix,
               x.begin() + static_cast<std::ptrdiff_t>((r + 1) * t));
  }
  return out;
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

hf::model_config tiny_llama() {
  hf::llama_config c;
  c.vocab_size = 23;
  c.hidden_size = 16;
  c.intermediate_size = 24;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 4;
  c.max_position_embeddings = 16;
  c.rms_norm_eps = 1e-5;
  return hf::model_config(c);
}

// Two prompts of 3, completions of 2 to 5 tokens in rows of 8: ids and next-token targets.
std::shared_ptr<ppo_batch> sampled_rows() {
  auto b = std::make_shared<ppo_batch>();
  b->rows = 4;
  b->seq = 8;
  testing::rng g(5);
  for (std::int64_t i = 0; i < 32; ++i)
    b->ids.push_back(static_cast<std::int32_t>(g.integer(0, 22)));
  b->targets.assign(32, -100);
  for (std::int64_t r = 0; r < 4; ++r)
    for (std::int64_t i = 2; i < 2 + 2 + r && i + 1 < 8; ++i)
      b->targets[r * 8 + i] = b->ids[r * 8 + i + 1];
  return b;
}

}  // namespace

TEST_CASE("PPO rewards, GAE, returns and both losses equal TRL's formulas in PyTorch", "[cpu]") {
  int seen = 0;
  for (const auto& c : fixture()) {
    ++seen;
    INFO("case " << c["seed"].get<int>());
    const std::int64_t rows = c["rows"], len = c["length"], vocab = c["vocab"], prefix = 2;
    const ppo_reward_options ro{.kl_coef = c["kl_coef"],
                                .kl = c["k3"].get<bool>() ? kl_estimator::k3 : kl_estimator::k1,
                                .whiten_rewards = c["whiten_rewards"],
                                .gamma = c["gamma"],
                                .lam = c["lam"]};
    const auto mask_v = c["mask"].get<std::vector<int>>();
    std::vector<std::uint8_t> mask(mask_v.begin(), mask_v.end());
    std::vector<double> wide_mask_d =
        shifted(std::vector<double>(mask_v.begin(), mask_v.end()), rows, prefix);
    std::vector<std::uint8_t> wide_mask(wide_mask_d.begin(), wide_mask_d.end());
    const auto old = c["old_logp"].get<std::vector<double>>();
    const auto ref = c["ref_logp"].get<std::vector<double>>();
    const auto old_values = c["old_values"].get<std::vector<double>>();
    const auto scores = c["scores"].get<std::vector<double>>();

    // Rewards, advantages and returns, with the responses after a prompt.
    const ppo_advantages a =
        ppo_token_advantages(shifted(old, rows, prefix), shifted(ref, rows, prefix),
                             shifted(old_values, rows, prefix), wide_mask, scores, ro);
    check_close(unshifted(a.rewards, rows, prefix), c["rewards"], "rewards");
    check_close(unshifted(a.advantages, rows, prefix), c["advantages"], "advantages");
    check_close(unshifted(a.returns, rows, prefix), c["returns"], "returns");
    CHECK(a.kl == Approx(c["kl_mean"].get<double>()).margin(1e-12));

    // The policy loss in log-probabilities from logits, and its gradient into them.
    auto logits_v = c["logits"].get<std::vector<double>>();
    auto targets_v = c["targets"].get<std::vector<std::int32_t>>();
    tensor logits(logits_v.data(), logits_v.size() * 8, dtype::f64, {rows * len, vocab});
    tensor targets(targets_v.data(), targets_v.size() * 4, dtype::i32, {rows * len});
    owned_tensor losses = empty({rows * len}, dtype::f64);
    const auto logp = token_logprobs(logits, targets, losses);
    const auto want_logp = c["new_logp"].get<std::vector<double>>();
    for (std::size_t i = 0; i < logp.size(); ++i)
      CHECK(logp[i] == Approx(want_logp[i]).margin(1e-12));
    const auto adv = c["advantages"].get<std::vector<double>>();
    const ppo_policy_result p = ppo_policy_loss(logp, old, adv, mask, c["cliprange"]);
    CHECK(p.loss == Approx(c["pg_loss"].get<double>()).margin(1e-12));
    CHECK(p.clipfrac == Approx(c["pg_clipfrac"].get<double>()).margin(1e-12));
    CHECK(p.approx_kl == Approx(c["approxkl"].get<double>()).margin(1e-12));
    CHECK(p.clipfrac > 0);  // the case reaches the clipped branch
    check_close(p.dlogp, c["dlogp"], "dlogp");
    owned_tensor dlogits = empty({rows * len, vocab}, dtype::f64);
    token_logprobs_backward(logits, targets, p.dlogp, losses, dlogits);
    const double* d = dlogits.data_as<double>();
    check_close(std::vector<double>(d, d + rows * len * vocab), c["dlogits"], "dlogits");
    CHECK(mean_token_entropy(logits, mask) == Approx(c["entropy"].get<double>()).margin(1e-12));

    // The value loss and its gradient in the values.
    const ppo_value_result v =
        ppo_value_loss(c["values"].get<std::vector<double>>(), old_values,
                       c["returns"].get<std::vector<double>>(), mask, c["cliprange_value"]);
    CHECK(v.loss == Approx(c["vf_loss"].get<double>()).margin(1e-12));
    CHECK(v.clipfrac == Approx(c["vf_clipfrac"].get<double>()).margin(1e-12));
    CHECK(v.clipfrac > 0);
    check_close(v.dvalues, c["dvalues"], "dvalues");
  }
  CHECK(seen == 3);
}

TEST_CASE("a PPO policy micro-batch backpropagates the gradient of the clipped objective",
          "[cpu]") {
  causal_lm_of<llama> policy(tiny(), batch_dims{4, 8}, dtype::f64);
  policy.init_weights(4);
  auto b = sampled_rows();
  // old: the policy's own log-probabilities moved by up to +-0.5, so ratios reach 0.6 to 1.65 and
  // some are clipped; advantages of both signs.
  b->old_logp = token_logprobs_of(policy, i32_rows(b->ids, 4, 8), i32_rows(b->targets, 4, 8));
  testing::rng g(9);
  b->advantages.assign(32, 0.0);
  for (std::size_t i = 0; i < 32; ++i)
    if (b->targets[i] != -100) {
      b->old_logp[i] += g.uniform(-0.5, 0.5);
      b->advantages[i] = g.uniform(-1.5, 1.5);
    }
  const ppo_options opt{.cliprange = 0.2};

  policy.memory().zero_grads();
  ppo_policy_report seen;
  const double loss =
      ppo_policy_micro_batch(b, opt, [&](const ppo_policy_report& r) { seen = r; })(policy, 0, 1.0);
  CHECK(loss == seen.loss.loss);
  CHECK(seen.loss.clipfrac > 0);
  CHECK(seen.entropy > 0);
  auto loss_at = [&]() { return ppo_policy_forward(policy, *b, opt).loss; };
  CHECK(loss_at() == Approx(loss).epsilon(1e-14));
  // f64 central differences (central_differences.test.hpp); the clip's kinks are where the loss
  // has no derivative: a parameter whose +-h crosses one shows as a mismatch, unlikely at 1e-5.
  testing::rng pick(2);
  std::vector<std::int64_t> at;
  for (int k = 0; k < 40; ++k) at.push_back(pick.integer(0, policy.memory().params().numel() - 1));
  testing::check_central_differences(policy.memory().params(), policy.memory().grads(), at,
                                     loss_at);
}

TEST_CASE("a PPO critic micro-batch backpropagates the gradient of the clipped value loss",
          "[cpu]") {
  value_model critic(tiny_llama(), batch_dims{4, 8}, /*pad_id=*/0, dtype::f64);
  critic.lm().init_weights(6);
  auto b = sampled_rows();
  const std::vector<double> v0 = critic.forward(i32_rows(b->ids, 4, 8));
  REQUIRE(v0.size() == 32);
  // Old values near the current ones (some beyond the clip range), returns away from both.
  testing::rng g(4);
  b->old_values.assign(32, 0.0);
  b->returns.assign(32, 0.0);
  for (std::size_t i = 0; i < 32; ++i)
    if (b->targets[i] != -100) {
      b->old_values[i] = v0[i] + g.uniform(-0.4, 0.4);
      b->returns[i] = v0[i] + g.uniform(-1.0, 1.0);
    }
  const ppo_options opt{.cliprange_value = 0.2, .vf_coef = 0.5};
  critic.lm().memory().zero_grads();
  ppo_value_result seen;
  const double loss = ppo_value_micro_batch(
      b, critic, opt, [&](const ppo_value_result& r) { seen = r; })(critic.lm(), 0, 1.0);
  CHECK(loss == Approx(0.5 * seen.loss).epsilon(1e-15));
  CHECK(seen.clipfrac > 0);
  CHECK(seen.clipfrac < 1);
  auto loss_at = [&]() { return 0.5 * ppo_value_forward(critic, *b, opt).loss; };
  CHECK(loss_at() == Approx(loss).epsilon(1e-14));
  const tensor& p = critic.lm().memory().params();
  testing::rng pick(3);
  std::vector<std::int64_t> at;
  for (int k = 0; k < 40; ++k) at.push_back(pick.integer(0, p.numel() - 1));
  testing::check_central_differences(p, critic.lm().memory().grads(), at, loss_at);
}

TEST_CASE("PPO's advantages and losses refuse inputs of mismatched sizes", "[cpu][faults]") {
  const std::vector<double> four(4, 0.5), three(3, 0.5);
  const std::vector<std::uint8_t> mask{0, 1, 1, 1};
  const std::vector<double> score{1.0};
  auto refused = [](const char* what, const std::function<void()>& f, const char* text) {
    try {
      f();
      FAIL(what << " was accepted");
    } catch (const error& e) {
      CHECK_THAT(e.what(), Catch::Contains(text));
      std::printf("faults: %s -> refused: %s\n", what, e.what());
    }
  };
  refused(
      "values of another length than the log-probabilities",
      [&] { ppo_token_advantages(four, four, three, mask, score, {}); },
      "4 log-probabilities but 3 values");
  refused(
      "a KL penalty without reference log-probabilities",
      [&] { ppo_token_advantages(four, {}, four, mask, score, {.kl_coef = 0.05}); },
      "kl_coef 0.05 needs 4 reference log-probabilities, got 0");
  refused(
      "returns of another length than the values",
      [&] { ppo_value_loss(four, four, three, mask, 0.2); }, "4 values but 4 old ones, 3 returns");
  refused(
      "a whitening over one token",
      [&] {
        masked_whiten(four, std::vector<std::uint8_t>{0, 0, 1, 0});
      },
      "1 masked entries");
}
