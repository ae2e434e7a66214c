// The PPO roles in one process (actors/ppo_roles.hpp): the critic's values are the value model's
// at the completion positions (0 elsewhere); an on-policy policy step on whitened advantages has
// ratio 1 (nothing clipped) and loss -mean(A) = 0; a critic step lowers the value loss on the same
// batch; versions count optimizer steps (epochs per batch); a request with a wrong number of
// per-token values is refused naming the actor.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "actors/one_rank_job.hpp"
#include "actors/ppo_roles.hpp"
#include "models/causal_lm.hpp"
#include "models/post/policy_logprobs.hpp"
#include "models/post/ppo_advantages.hpp"
#include "models/post/value_model.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::actors;

namespace {

// A random tiny Llama (llama-tiny: 4 x 128, byte vocabulary) saved in HF layout.
std::string tiny_checkpoint() {
  const auto dir =
      std::filesystem::temp_directory_path() / ("troupe-ppo-roles-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto cfg = models::named_model_config("llama-tiny").value();
  auto m = models::make_causal_lm(cfg, {1, 8});
  m->init_weights(3);
  models::train_config tc;
  tc.batch = 1;
  tc.seq = 8;
  models::trainer t(*m, tc);
  return t.save(dir, cfg).value().string();
}

}  // namespace

TEST_CASE("PPO policy and critic actors train on the driver's advantages and returns",
          "[cpu][faults]") {
  const std::string ckpt = tiny_checkpoint();
  one_rank_job w(
      [](role_registry& r) {
        add_ppo_roles(r, [](std::span<const std::int32_t>, std::span<const std::int32_t> c) {
          return c.empty() ? 0.0 : static_cast<double>(c[0] % 2);
        });
      },
      "ppo-roles-test");
  {
    job j(*w.n);
    const auto rollout = j.spawn("grpo_rollout", 0);
    const auto policy = j.spawn("ppo_policy", 0);
    const auto critic = j.spawn("ppo_critic", 0);
    const auto reward = j.spawn("grpo_reward", 0);
    ppo_trainer_setup ps;
    ps.model = {ckpt, 8, 7};
    ps.lr = 1e-3;
    ps.epochs = 1;
    ppo_trainer_setup cs = ps;
    cs.epochs = 3;
    cs.seed = 11;
    j.ask<std::int64_t>(policy, ps);
    j.ask<std::int64_t>(critic, cs);
    j.ask<std::int64_t>(rollout, grpo_model_setup{ckpt, 8, 7});
    CHECK(j.ask<grpo_push_reply>(policy, grpo_push_request{{rollout}}).version == 0);

    grpo_rollout_request rq;
    rq.prompts = {'1', '+', '2', '=', '3', '+', '4', '='};  // 2 prompts of 4
    rq.prompt_len = 4;
    rq.group = 4;
    rq.max_new = 3;
    rq.seed = 5;
    const auto s = j.ask<grpo_samples>(rollout, rq);
    REQUIRE(s.rows == 8);
    const auto mask = models::completion_mask(s.targets);

    // The critic's values: the value model's (same checkpoint, same score seed) at the completion
    // positions, 0 elsewhere. Same kernels, rows and weights: equal bit for bit.
    const auto values = j.ask<std::vector<double>>(critic, ppo_value_request{s});
    REQUIRE(values.size() == 56);
    models::value_model alone(models::hf::read_config(ckpt).value(), {8, 7}, 0);
    alone.lm().init_weights(11);
    REQUIRE(alone.scored().load(ckpt, false).has_value());
    const auto want = alone.forward(models::i32_rows(s.ids, 8, 7));
    for (std::size_t i = 0; i < 56; ++i) CHECK(values[i] == (mask[i] ? want[i] : 0.0));

    const auto scores = j.ask<std::vector<double>>(reward, grpo_reward_request{s});
    const auto adv =
        models::ppo_token_advantages(s.old_logp, {}, values, mask, scores, {.kl_coef = 0.0});

    // On-policy, one epoch: every ratio is 1 up to the rounding of the log-probabilities (the
    // rollout's forward and the trainer's are of the same rows and weights: the same kernels, so
    // ~1e-7), so nothing is clipped and the loss is -mean(A) = 0 for whitened advantages.
    const auto step = j.ask<ppo_train_reply>(policy, ppo_policy_train_request{s, adv.advantages});
    CHECK(step.version == 1);
    CHECK(step.clipfrac == 0.0);
    CHECK(std::abs(step.loss) < 1e-6);
    CHECK(step.entropy > 0);
    CHECK(step.grad_norm > 0);

    // Three critic epochs on one batch: the value loss falls (its first epoch's value is at the
    // old values, so at most the unclipped loss; the mean over three epochs is below it).
    const auto first =
        j.ask<ppo_train_reply>(critic, ppo_critic_train_request{s, values, adv.returns});
    CHECK(first.version == 3);
    const auto again =
        j.ask<ppo_train_reply>(critic, ppo_critic_train_request{s, values, adv.returns});
    CHECK(again.version == 6);
    CHECK(again.loss < first.loss);

    auto bad = j.try_ask_all<ppo_train_reply>(std::span(&critic, 1),
                                              ppo_critic_train_request{s, values, {1.0, 2.0}});
    REQUIRE_FALSE(bad.front().has_value());
    CHECK_THAT(bad.front().error_message(),
               Catch::Contains("ppo_critic@0") && Catch::Contains("56 per-token values needed"));
    std::printf("faults: a critic step with 2 returns for 56 positions -> refused: %s\n",
                bad.front().error_message().c_str());
  }
  std::filesystem::remove_all(std::filesystem::path(ckpt));
}
