// grpo_step: GRPO micro-batches on the trunk (grpo_step.hpp).
#include "models/post/grpo_step.hpp"

#include "memory/error.hpp"

namespace troupe::models {
namespace {

void check_batch(const grpo_batch& b, const grpo_options& opt) {
  const auto n = static_cast<std::size_t>(b.rows * b.seq);
  TROUPE_CHECK(b.rows > 0 && b.seq > 0 && b.ids.size() == n && b.targets.size() == n,
               "grpo: a batch of ", b.rows, " x ", b.seq, " needs ", n, " ids and targets, got ",
               b.ids.size(), " and ", b.targets.size());
  TROUPE_CHECK(b.old_logp.size() == n, "grpo: ", n, " old log-probabilities needed, got ",
               b.old_logp.size());
  TROUPE_CHECK(opt.beta == 0 || b.ref_logp.size() == n, "grpo: beta ", opt.beta, " needs ", n,
               " reference log-probabilities, got ", b.ref_logp.size());
  TROUPE_CHECK(b.advantages.size() == static_cast<std::size_t>(b.rows), "grpo: ", b.rows,
               " advantages needed, got ", b.advantages.size());
}

}  // namespace

grpo_result grpo_forward(causal_lm& policy, const grpo_batch& b, const grpo_options& opt) {
  check_batch(b, opt);
  const std::vector<double> logp =
      token_logprobs_of(policy, i32_rows(b.ids, b.rows, b.seq), i32_rows(b.targets, b.rows, b.seq));
  return grpo_loss(logp, b.old_logp, b.ref_logp, completion_mask(b.targets), b.advantages, opt);
}

trainer::micro_batch grpo_micro_batch(std::shared_ptr<const grpo_batch> batch,
                                      const grpo_options& opt,
                                      std::function<void(const grpo_result&)> on_result) {
  return [batch, opt, on_result](causal_lm& policy, std::uint64_t, double loss_scale) {
    const grpo_batch& b = *batch;
    const grpo_result r = grpo_forward(policy, b, opt);
    backward_from_logprobs(policy, i32_rows(b.targets, b.rows, b.seq), r.dlogp, loss_scale, "grpo");
    if (on_result) on_result(r);
    return r.loss;
  };
}

}  // namespace troupe::models
