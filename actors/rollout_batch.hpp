// rollout_batch: one batch of sampled rows from the rollout actors of an RL loop (GRPO:
// grpo_loop.hpp, PPO: ppo_loop.hpp). The request is fanned out to every actor (each samples its
// share of the prompts, grpo_rollout_request::split) and their rows are joined in actor order.
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <optional>
#include <utility>
#include <vector>

#include "actors/grpo_roles.hpp"
#include "memory/error.hpp"

namespace troupe::actors {

struct rollout_batch {
  grpo_samples samples;        // every rollout actor's rows, in order; version: the oldest
  double seconds = 0;          // the slowest actor's generation
  double logprob_seconds = 0;  // the slowest actor's old log-probabilities
};

// Asks `rollouts` for r (its split is set here to their names) and joins their replies.
rollout_batch sample_rollouts(job& j, const std::vector<role_handle>& rollouts,
                              grpo_rollout_request r, std::chrono::milliseconds timeout);

// Iteration k's batch from the rollout actors (their weights at least min_version) for a loop's
// options (grpo_loop_options, ppo_loop_options: prompts, prompt_len, group, max_new,
// temperature, top_p, eos, seed, timeout); `tokens`: the iteration's prompts, one length each
// (up to prompt_len); `loop` names the loop in errors.
template <class Options>
rollout_batch sample_iteration(job& j, const std::vector<role_handle>& rollouts, const Options& opt,
                               std::vector<std::int32_t> tokens, std::int64_t k,
                               std::int64_t min_version, const char* loop) {
  grpo_rollout_request r;
  r.prompts = std::move(tokens);
  const auto n = static_cast<std::int64_t>(r.prompts.size());
  TROUPE_CHECK(n > 0 && n % opt.prompts == 0 && n / opt.prompts <= opt.prompt_len, loop,
               ": iteration ", k, " has ", n, " prompt tokens, not ", opt.prompts,
               " prompts of up to ", opt.prompt_len);
  r.prompt_len = n / opt.prompts;
  r.group = opt.group;
  r.max_new = opt.max_new;
  r.temperature = opt.temperature;
  r.top_p = opt.top_p;
  r.eos = opt.eos;
  r.seed = opt.seed * 1000003 + static_cast<std::uint64_t>(k) * rollouts.size();
  r.min_version = min_version;
  return sample_rollouts(j, rollouts, std::move(r), opt.timeout);
}

// The batches of an RL loop's iterations (GRPO, PPO). take(k, v) returns iteration k's batch:
// the one sample_next started during the previous iteration, else sampled now by weights of at
// least version v. sample_next(k, v) (staleness 1) samples iteration k's batch on another thread,
// with its own job, while the caller trains; finish_next waits for it (before the weights move).
class rollout_pipeline {
 public:
  using sampler = std::function<rollout_batch(job&, std::int64_t k, std::int64_t min_version)>;
  rollout_pipeline(node& n, sampler sample) : n_(n), sample_(std::move(sample)) {}
  rollout_batch take(job& j, std::int64_t k, std::int64_t min_version) {
    if (!ready_) return sample_(j, k, min_version);
    rollout_batch b = std::move(*ready_);
    ready_.reset();
    return b;
  }
  void sample_next(std::int64_t k, std::int64_t min_version) {
    ahead_ = std::async(std::launch::async, [this, k, min_version] {
      job side(n_);  // a job object belongs to one thread
      return sample_(side, k, min_version);
    });
  }
  void finish_next() { ready_ = ahead_.get(); }

 private:
  node& n_;
  sampler sample_;
  std::future<rollout_batch> ahead_;  // destroyed first: waits for the thread that uses sample_
  std::optional<rollout_batch> ready_;
};

}  // namespace troupe::actors
