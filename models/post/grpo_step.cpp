// grpo_step: GRPO micro-batches on the trunk (grpo_step.hpp).
#include "models/post/grpo_step.hpp"

#include "memory/error.hpp"
#include "models/post/token_logprob.hpp"

namespace troupe::models {
namespace {

tensor i32_rows(const std::vector<std::int32_t>& v, std::int64_t rows, std::int64_t seq) {
  return tensor(const_cast<std::int32_t*>(v.data()), v.size() * 4, dtype::i32, {rows, seq});
}

std::vector<std::uint8_t> completion_mask(const std::vector<std::int32_t>& targets) {
  std::vector<std::uint8_t> m(targets.size());
  for (std::size_t i = 0; i < targets.size(); ++i) m[i] = targets[i] != -100;
  return m;
}

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

std::vector<double> token_logprobs_of(causal_lm& m, const tensor& ids, const tensor& targets) {
  m.forward(ids, targets);
  const tensor logits = m.logits();
  owned_tensor scratch = empty({logits.size(0)}, logits.type(), logits.dev());
  return token_logprobs(logits, targets.reshape({ids.numel()}), scratch);
}

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
    const tensor logits = policy.logits();
    const tensor targets = i32_rows(b.targets, b.rows, b.seq).reshape({b.rows * b.seq});
    owned_tensor scratch = empty({1}, logits.type(), logits.dev());
    TROUPE_CHECK(policy.set_logit_grads([&](const tensor& dlogits, double dloss) {
      std::vector<double> d(r.dlogp);
      for (auto& x : d) x *= dloss;
      token_logprobs_backward(logits, targets, d, scratch, dlogits);
    }),
                 "grpo: the policy model cannot take the logits' gradient");
    policy.backward(loss_scale);
    policy.set_logit_grads({});
    if (on_result) on_result(r);
    return r.loss;
  };
}

}  // namespace troupe::models
