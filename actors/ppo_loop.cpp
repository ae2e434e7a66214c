// ppo_loop: the PPO driver (ppo_loop.hpp).
#include "actors/ppo_loop.hpp"

#include <future>
#include <tuple>

#include "actors/rl_plan_trainer.hpp"
#include "actors/rollout_batch.hpp"
#include "memory/error.hpp"
#include "models/post/policy_logprobs.hpp"

namespace troupe::actors {
namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

// Iteration k's batch from the rollout actors (their weights at least min_version).
rollout_batch sample(job& j, const std::vector<role_handle>& rollouts, const ppo_loop_options& opt,
                     const grpo_prompt_source& prompts, std::int64_t k, std::int64_t min_version) {
  return sample_iteration(j, rollouts, opt, prompts(k), k, min_version, "ppo");
}

}  // namespace

std::vector<ppo_iteration> run_ppo(node& n, const ppo_loop_options& opt,
                                   const grpo_prompt_source& prompts,
                                   const std::function<void(const ppo_iteration&)>& on_iteration,
                                   const ppo_save_fn& on_save) {
  const auto r = static_cast<std::int64_t>(opt.rollout_ranks.size());
  TROUPE_CHECK(r > 0 && opt.prompts > 0 && opt.prompts % r == 0, "ppo: ", opt.prompts,
               " prompts per iteration do not split over ", r, " rollout actors");
  TROUPE_CHECK(opt.staleness == 0 || opt.staleness == 1, "ppo: staleness ", opt.staleness,
               " is not 0 (sync) or 1 (async)");
  TROUPE_CHECK(opt.prompt_len > 0 && opt.group > 0 && opt.max_new > 0, "ppo: prompt_len ",
               opt.prompt_len, ", group ", opt.group, " and max_new ", opt.max_new,
               " must be positive");
  const std::int64_t seq = opt.prompt_len + opt.max_new, rows = opt.prompts * opt.group;
  job j(n);
  std::vector<role_handle> rollouts;
  for (int rank : opt.rollout_ranks) rollouts.push_back(j.spawn("grpo_rollout", rank));
  // One ppo_policy, or the plan's grid of rl_plan_trainer actors (every one asked the same).
  const bool planned = !opt.plan_config.empty();
  std::vector<role_handle> policies;
  if (planned)
    for (int r = 0; r < opt.plan_ranks; ++r) policies.push_back(j.spawn("rl_plan_trainer", r));
  else
    policies.push_back(j.spawn("ppo_policy", opt.policy_rank));
  const role_handle policy = policies.front();
  const role_handle critic = j.spawn("ppo_critic", opt.critic_rank);
  const role_handle reward = j.spawn("grpo_reward", opt.reward_rank);
  const bool use_reference = opt.rewards.kl_coef != 0;
  role_handle reference;
  if (use_reference) reference = j.spawn("grpo_reference", opt.reference_rank);

  ppo_trainer_setup ps = opt.policy, cs = opt.critic;
  ps.model = {opt.checkpoint, rows, seq};
  cs.model = {opt.critic_checkpoint.empty() ? opt.checkpoint : opt.critic_checkpoint, rows, seq};
  if (planned)
    j.ask_all<std::int64_t>(policies,
                            rl_plan_setup{.config = opt.plan_config,
                                          .cliprange = opt.policy.cliprange,
                                          .epochs = opt.policy.epochs},
                            opt.timeout);
  else
    j.ask<std::int64_t>(policy, ps, opt.timeout);
  j.ask<std::int64_t>(critic, cs, opt.timeout);
  j.ask_all<std::int64_t>(rollouts, grpo_model_setup{opt.checkpoint, rows / r, seq}, opt.timeout);
  if (use_reference)
    j.ask<std::int64_t>(reference, grpo_model_setup{opt.checkpoint, rows, seq}, opt.timeout);
  auto push = [&]() {
    // Under a plan every piece takes part in gathering the policy; rank 0 sends it.
    return j.ask_all<grpo_push_reply>(policies, grpo_push_request{rollouts}, opt.timeout)
        .front()
        .version;
  };
  std::int64_t version = push();  // 0: the checkpoint's weights

  std::vector<ppo_iteration> out;
  // Async: the next batch, sampled while the policy trains.
  rollout_pipeline batches(n, [&](job& jj, std::int64_t k, std::int64_t min_version) {
    return sample(jj, rollouts, opt, prompts, k, min_version);
  });
  for (std::int64_t k = 0; k < opt.iterations; ++k) {
    const auto t0 = clock_type::now();
    ppo_iteration it;
    it.iteration = k + 1;
    const bool more = k + 1 < opt.iterations;
    auto t = clock_type::now();
    rollout_batch cur = batches.take(j, k, version);
    it.wait_seconds = since(t);
    if (opt.staleness == 1 && more) batches.sample_next(k + 1, version);
    const grpo_samples& s = cur.samples;
    it.sampled_by = s.version;
    it.generate_seconds = cur.seconds;
    it.logprob_seconds = cur.logprob_seconds;
    for (auto l : s.lengths) it.new_tokens += l;

    t = clock_type::now();
    const auto scores = j.ask<std::vector<double>>(reward, grpo_reward_request{s}, opt.timeout);
    it.reward_seconds = since(t);
    for (double x : scores) it.mean_reward += x / static_cast<double>(scores.size());

    // The reference's log-probabilities and the critic's values, on their actors at once.
    t = clock_type::now();
    std::future<std::vector<double>> values =
        std::async(std::launch::async, [&n, &critic, &s, &opt] {
          job side(n);
          return side.ask<std::vector<double>>(critic, ppo_value_request{s}, opt.timeout);
        });
    std::vector<double> ref_logp;
    if (use_reference)
      ref_logp = j.ask<std::vector<double>>(reference, grpo_reference_request{s}, opt.timeout);
    const std::vector<double> old_values = values.get();
    it.values_seconds = since(t);

    const models::ppo_advantages adv = models::ppo_token_advantages(
        s.old_logp, ref_logp, old_values, models::completion_mask(s.targets), scores, opt.rewards);
    it.kl = adv.kl;
    it.non_score_reward = adv.non_score_reward;

    // The policy's and the critic's epochs, on their actors at once.
    t = clock_type::now();
    std::future<ppo_train_reply> critic_step =
        std::async(std::launch::async, [&n, &critic, &s, &opt, &old_values, &adv] {
          job side(n);
          return side.ask<ppo_train_reply>(
              critic, ppo_critic_train_request{s, old_values, adv.returns}, opt.timeout);
        });
    const ppo_policy_train_request pr{s, adv.advantages};
    it.policy =
        planned
            ? combine_ppo_plan_replies(j.ask_all<ppo_plan_train_reply>(policies, pr, opt.timeout))
            : j.ask<ppo_train_reply>(policy, pr, opt.timeout);
    it.critic = critic_step.get();
    it.train_seconds = since(t);
    if (more) {
      if (opt.staleness == 1) {  // the overlapped sampling ends before the weights move
        t = clock_type::now();
        batches.finish_next();
        it.wait_seconds += since(t);
      }
      t = clock_type::now();
      version = push();
      it.sync_seconds = since(t);
    }
    it.seconds = since(t0);
    out.push_back(it);
    if (on_iteration) on_iteration(it);
    if (!more || (opt.save_every > 0 && (k + 1) % opt.save_every == 0)) {
      for (const auto& [who, h, dir] : {std::tuple{"policy", policy, opt.save_dir},
                                        std::tuple{"critic", critic, opt.critic_save_dir}}) {
        if (dir.empty()) continue;
        const bool pieces = planned && h.name == policy.name;  // every piece saves together
        const auto saved =
            pieces
                ? j.ask_all<grpo_save_reply>(policies, grpo_save_request{dir}, opt.timeout).front()
                : j.ask<grpo_save_reply>(h, grpo_save_request{dir}, opt.timeout);
        if (on_save) on_save(who, saved, dir);
      }
    }
  }
  for (const auto& h : rollouts) j.stop(h);
  for (const auto& h : policies) j.stop(h);
  j.stop(critic);
  j.stop(reward);
  if (use_reference) j.stop(reference);
  return out;
}

}  // namespace troupe::actors
