// grpo_loop: the GRPO driver (grpo_loop.hpp).
#include "actors/grpo_loop.hpp"

#include "actors/rl_plan_trainer.hpp"
#include "actors/rollout_batch.hpp"
#include "memory/error.hpp"
#include "models/post/grpo_loss.hpp"

namespace troupe::actors {
namespace {

using clock_type = std::chrono::steady_clock;

double since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

using batch = rollout_batch;

// Iteration k's batch from the rollout actors (their weights at least min_version).
batch sample(job& j, const std::vector<role_handle>& rollouts, const grpo_loop_options& opt,
             const grpo_prompt_source& prompts, std::int64_t k, std::int64_t min_version) {
  return sample_iteration(j, rollouts, opt, prompts(k), k, min_version, "grpo");
}

}  // namespace

std::vector<grpo_iteration> run_grpo(
    node& n, const grpo_loop_options& opt, const grpo_prompt_source& prompts,
    const std::function<void(const grpo_iteration&)>& on_iteration,
    const std::function<void(const grpo_save_reply&, const std::string& dir)>& on_save) {
  const auto r = static_cast<std::int64_t>(opt.rollout_ranks.size());
  TROUPE_CHECK(r > 0 && opt.prompts > 0 && opt.prompts % r == 0, "grpo: ", opt.prompts,
               " prompts per iteration do not split over ", r, " rollout actors");
  TROUPE_CHECK(opt.staleness == 0 || opt.staleness == 1, "grpo: staleness ", opt.staleness,
               " is not 0 (sync) or 1 (async)");
  TROUPE_CHECK(opt.prompt_len > 0 && opt.group > 1 && opt.max_new > 0, "grpo: prompt_len ",
               opt.prompt_len, ", group ", opt.group, " (> 1) and max_new ", opt.max_new,
               " must be positive");
  const std::int64_t seq = opt.prompt_len + opt.max_new, rows = opt.prompts * opt.group;
  job j(n);
  std::vector<role_handle> rollouts;
  for (int rank : opt.rollout_ranks) rollouts.push_back(j.spawn("grpo_rollout", rank));
  // One grpo_trainer, or the plan's grid of rl_plan_trainer actors (every one asked the same).
  const bool planned = !opt.plan_config.empty();
  std::vector<role_handle> trainers;
  if (planned)
    for (int r = 0; r < opt.plan_ranks; ++r) trainers.push_back(j.spawn("rl_plan_trainer", r));
  else
    trainers.push_back(j.spawn("grpo_trainer", opt.trainer_rank));
  const role_handle trainer = trainers.front();
  const role_handle reward = j.spawn("grpo_reward", opt.reward_rank);
  const bool use_reference = opt.trainer.beta != 0;
  role_handle reference;
  if (use_reference) reference = j.spawn("grpo_reference", opt.reference_rank);

  grpo_trainer_setup ts = opt.trainer;
  ts.model = {opt.checkpoint, rows, seq};
  if (planned)
    j.ask_all<std::int64_t>(trainers,
                            rl_plan_setup{opt.plan_config, opt.trainer.epsilon, opt.trainer.beta},
                            opt.timeout);
  else
    j.ask<std::int64_t>(trainer, ts, opt.timeout);
  j.ask_all<std::int64_t>(rollouts, grpo_model_setup{opt.checkpoint, rows / r, seq}, opt.timeout);
  if (use_reference)
    j.ask<std::int64_t>(reference, grpo_model_setup{opt.checkpoint, rows, seq}, opt.timeout);
  auto push = [&]() {
    // Under a plan every piece takes part in gathering the policy; rank 0 sends it.
    return j.ask_all<grpo_push_reply>(trainers, grpo_push_request{rollouts}, opt.timeout).front();
  };
  auto train = [&](const grpo_train_request& tr) {
    if (!planned) return j.ask<grpo_train_reply>(trainer, tr, opt.timeout);
    return combine_grpo_plan_replies(j.ask_all<grpo_plan_train_reply>(trainers, tr, opt.timeout));
  };
  push();  // version 0: the checkpoint's weights

  std::vector<grpo_iteration> out;
  // Async: the next batch, sampled while the trainer steps.
  rollout_pipeline batches(n, [&](job& jj, std::int64_t k, std::int64_t min_version) {
    return sample(jj, rollouts, opt, prompts, k, min_version);
  });
  for (std::int64_t k = 0; k < opt.iterations; ++k) {
    const auto t0 = clock_type::now();
    grpo_iteration it;
    it.iteration = k + 1;
    const bool more = k + 1 < opt.iterations;
    // Sync: batch k by the trainer's weights (version k). Async: batch k was sampled during
    // iteration k - 1 by version k - 1; batch k + 1 starts now, by version k.
    auto t = clock_type::now();
    batch cur = batches.take(j, k, k);
    it.wait_seconds = since(t);
    if (opt.staleness == 1 && more) batches.sample_next(k + 1, k);
    const grpo_samples& s = cur.samples;
    it.sampled_by = s.version;
    it.generate_seconds = cur.seconds;
    it.logprob_seconds = cur.logprob_seconds;
    for (auto l : s.lengths) it.new_tokens += l;

    t = clock_type::now();
    const auto rewards = j.ask<std::vector<double>>(reward, grpo_reward_request{s}, opt.timeout);
    it.reward_seconds = since(t);
    for (double x : rewards) it.mean_reward += x;
    it.mean_reward /= static_cast<double>(rewards.size());

    grpo_train_request tr;
    if (use_reference) {
      t = clock_type::now();
      tr.ref_logp = j.ask<std::vector<double>>(reference, grpo_reference_request{s}, opt.timeout);
      it.reference_seconds = since(t);
    }
    tr.advantages = models::group_advantages(rewards, opt.group);
    tr.samples = std::move(cur.samples);
    t = clock_type::now();
    it.train = train(tr);
    it.train_seconds = since(t);
    if (more) {
      if (opt.staleness == 1) {  // the overlapped sampling ends before the weights move
        t = clock_type::now();
        batches.finish_next();
        it.wait_seconds += since(t);
      }
      t = clock_type::now();
      push();
      it.sync_seconds = since(t);
    }
    it.seconds = since(t0);
    out.push_back(it);
    if (on_iteration) on_iteration(it);
    if (!opt.save_dir.empty() && (!more || (opt.save_every > 0 && (k + 1) % opt.save_every == 0))) {
      const auto saved =
          j.ask_all<grpo_save_reply>(trainers, grpo_save_request{opt.save_dir}, opt.timeout)
              .front();
      if (on_save) on_save(saved, opt.save_dir);
    }
  }
  for (const auto& h : rollouts) j.stop(h);
  for (const auto& h : trainers) j.stop(h);
  j.stop(reward);
  if (use_reference) j.stop(reference);
  return out;
}

}  // namespace troupe::actors
