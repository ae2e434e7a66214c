// rollout_batch: a batch gathered from the rollout actors (rollout_batch.hpp).
#include "actors/rollout_batch.hpp"

#include <algorithm>
#include <utility>

namespace troupe::actors {

rollout_batch sample_rollouts(job& j, const std::vector<role_handle>& rollouts,
                              grpo_rollout_request r, std::chrono::milliseconds timeout) {
  r.split.clear();
  for (const auto& h : rollouts) r.split.push_back(h.name);
  auto parts = j.ask_all<grpo_samples>(rollouts, r, timeout);
  rollout_batch b;
  b.samples = std::move(parts.front());
  b.seconds = b.samples.generate_seconds;
  b.logprob_seconds = b.samples.logprob_seconds;
  for (std::size_t i = 1; i < parts.size(); ++i) {
    auto& p = parts[i];
    auto& s = b.samples;
    s.rows += p.rows;
    s.ids.insert(s.ids.end(), p.ids.begin(), p.ids.end());
    s.targets.insert(s.targets.end(), p.targets.begin(), p.targets.end());
    s.lengths.insert(s.lengths.end(), p.lengths.begin(), p.lengths.end());
    s.old_logp.insert(s.old_logp.end(), p.old_logp.begin(), p.old_logp.end());
    s.version = std::min(s.version, p.version);
    b.seconds = std::max(b.seconds, p.generate_seconds);
    b.logprob_seconds = std::max(b.logprob_seconds, p.logprob_seconds);
  }
  return b;
}

}  // namespace troupe::actors
