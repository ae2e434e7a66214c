// ppo_step: PPO's policy and critic micro-batches (ppo_step.hpp).
#include "models/post/ppo_step.hpp"

#include "memory/error.hpp"

namespace troupe::models {
namespace {

void check_batch(const ppo_batch& b, bool policy) {
  const auto n = static_cast<std::size_t>(b.rows * b.seq);
  TROUPE_CHECK(b.rows > 0 && b.seq > 0 && b.ids.size() == n && b.targets.size() == n,
               "ppo: a batch of ", b.rows, " x ", b.seq, " needs ", n, " ids and targets, got ",
               b.ids.size(), " and ", b.targets.size());
  if (policy)
    TROUPE_CHECK(b.old_logp.size() == n && b.advantages.size() == n, "ppo: ", n,
                 " old log-probabilities and advantages needed, got ", b.old_logp.size(), " and ",
                 b.advantages.size());
  else
    TROUPE_CHECK(b.old_values.size() == n && b.returns.size() == n, "ppo: ", n,
                 " old values and returns needed, got ", b.old_values.size(), " and ",
                 b.returns.size());
}

}  // namespace

ppo_policy_result ppo_policy_forward(causal_lm& policy, const ppo_batch& b,
                                     const ppo_options& opt) {
  check_batch(b, true);
  const std::vector<double> logp =
      token_logprobs_of(policy, i32_rows(b.ids, b.rows, b.seq), i32_rows(b.targets, b.rows, b.seq));
  return ppo_policy_loss(logp, b.old_logp, b.advantages, completion_mask(b.targets), opt.cliprange);
}

ppo_value_result ppo_value_forward(value_model& critic, const ppo_batch& b,
                                   const ppo_options& opt) {
  check_batch(b, false);
  const std::vector<double> v = critic.forward(i32_rows(b.ids, b.rows, b.seq));
  return ppo_value_loss(v, b.old_values, b.returns, completion_mask(b.targets),
                        opt.cliprange_value);
}

trainer::micro_batch ppo_policy_micro_batch(
    std::shared_ptr<const ppo_batch> batch, const ppo_options& opt,
    std::function<void(const ppo_policy_report&)> on_result) {
  return [batch, opt, on_result](causal_lm& policy, std::uint64_t, double loss_scale) {
    const ppo_batch& b = *batch;
    ppo_policy_report r;
    r.loss = ppo_policy_forward(policy, b, opt);
    if (on_result) r.entropy = mean_token_entropy(policy.logits(), completion_mask(b.targets));
    backward_from_logprobs(policy, i32_rows(b.targets, b.rows, b.seq), r.loss.dlogp, loss_scale,
                           "ppo");
    if (on_result) on_result(r);
    return r.loss.loss;
  };
}

trainer::micro_batch ppo_value_micro_batch(std::shared_ptr<const ppo_batch> batch,
                                           value_model& critic, const ppo_options& opt,
                                           std::function<void(const ppo_value_result&)> on_result) {
  return [batch, &critic, opt, on_result](causal_lm& model, std::uint64_t, double loss_scale) {
    TROUPE_CHECK(&model == &critic.lm(), "ppo: the critic's trainer must train the value model");
    const ppo_batch& b = *batch;
    ppo_value_result r = ppo_value_forward(critic, b, opt);
    for (auto& d : r.dvalues) d *= opt.vf_coef;
    critic.backward(r.dvalues, loss_scale);
    if (on_result) on_result(r);
    return opt.vf_coef * r.loss;
  };
}

}  // namespace troupe::models
