// The GRPO roles in one process (actors/grpo_roles.hpp): a rollout actor holds no weights until
// the trainer pushes them, refuses a request that needs newer ones (naming itself and both
// versions), samples with the pushed weights (its log-probabilities are the trainer's own on the
// same rows, so a synchronous step's ratio is 1), and takes the next version after a step.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "actors/grpo_roles.hpp"
#include "actors/one_rank_job.hpp"
#include "models/causal_lm.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::actors;

namespace {

// A random tiny Llama (llama-tiny: 4 x 128, byte vocabulary) saved in HF layout.
std::string tiny_checkpoint() {
  const auto dir =
      std::filesystem::temp_directory_path() / ("troupe-grpo-roles-" + std::to_string(::getpid()));
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

TEST_CASE("GRPO rollout actors sample with the weights the trainer pushed", "[cpu][faults]") {
  const std::string ckpt = tiny_checkpoint();
  one_rank_job w(
      [](role_registry& r) {
        add_grpo_roles(r, [](std::span<const std::int32_t>, std::span<const std::int32_t> c) {
          return c.empty() ? 0.0 : static_cast<double>(c[0] % 2);
        });
      },
      "grpo-roles-test");
  {
    job j(*w.n);
    const auto rollout = j.spawn("grpo_rollout", 0);
    const auto trainer = j.spawn("grpo_trainer", 0);
    const auto reward = j.spawn("grpo_reward", 0);
    grpo_trainer_setup ts;
    ts.model = {ckpt, 8, 7};
    ts.lr = 1e-3;
    ts.beta = 0;
    j.ask<std::int64_t>(trainer, ts);
    CHECK(j.ask<std::int64_t>(rollout, grpo_model_setup{ckpt, 8, 7}) == -1);

    grpo_rollout_request rq;
    rq.prompts = {'1', '+', '2', '=', '3', '+', '4', '='};  // 2 prompts of 4
    rq.prompt_len = 4;
    rq.group = 4;
    rq.max_new = 3;
    rq.seed = 5;
    rq.min_version = 0;
    auto early = j.try_ask_all<grpo_samples>(std::span(&rollout, 1), rq);
    REQUIRE_FALSE(early.front().has_value());
    CHECK_THAT(early.front().error_message(),
               Catch::Contains("grpo_rollout@0") &&
                   Catch::Contains("holds weights v-1 but the request needs v0"));
    std::printf("faults: a rollout before any weights -> refused: %s\n",
                early.front().error_message().c_str());

    CHECK(j.ask<grpo_push_reply>(trainer, grpo_push_request{{rollout}}).version == 0);
    CHECK(j.ask<std::int64_t>(rollout, grpo_version_request{}) == 0);
    const auto s = j.ask<grpo_samples>(rollout, rq);
    CHECK(s.version == 0);
    REQUIRE(s.rows == 8);
    REQUIRE(s.seq == 7);

    // A step on those rows: with the sampler's weights the ratio is 1 (nothing clipped) and,
    // beta being 0, the loss is -mean(A) = 0 up to the rounding of the log-probabilities (the
    // trainer's forward is of the same rows, batch and weights: the same kernels, so ~1e-7).
    auto rewards = j.ask<std::vector<double>>(reward, grpo_reward_request{s});
    REQUIRE(rewards.size() == 8);
    grpo_train_request tr;
    tr.samples = s;
    tr.advantages = {1, -1, 0.5, -0.5, 1, -1, 0.5, -0.5};
    const auto step = j.ask<grpo_train_reply>(trainer, tr);
    CHECK(step.version == 1);
    CHECK(step.clip_ratio == 0.0);
    CHECK(std::abs(step.loss) < 1e-6);
    CHECK(step.grad_norm > 0);

    CHECK(j.ask<grpo_push_reply>(trainer, grpo_push_request{{rollout}}).version == 1);
    CHECK(j.ask<std::int64_t>(rollout, grpo_version_request{}) == 1);
    rq.min_version = 1;  // now served
    const auto again = j.ask<grpo_samples>(rollout, rq);
    CHECK(again.version == 1);
  }
  std::filesystem::remove_all(std::filesystem::path(ckpt));
}
