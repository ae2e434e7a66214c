// policy_logprobs: per-token log-probabilities of sampled rows and their backward
// (policy_logprobs.hpp).
#include "models/post/policy_logprobs.hpp"

#include "memory/error.hpp"
#include "models/post/token_logprob.hpp"

namespace troupe::models {

tensor i32_rows(const std::vector<std::int32_t>& v, std::int64_t rows, std::int64_t seq) {
  TROUPE_CHECK(static_cast<std::int64_t>(v.size()) == rows * seq, "rows of ", rows, " x ", seq,
               " need ", rows * seq, " ids, got ", v.size());
  return tensor(const_cast<std::int32_t*>(v.data()), v.size() * 4, dtype::i32, {rows, seq});
}

std::vector<std::uint8_t> completion_mask(std::span<const std::int32_t> targets) {
  std::vector<std::uint8_t> m(targets.size());
  for (std::size_t i = 0; i < targets.size(); ++i) m[i] = targets[i] != -100;
  return m;
}

std::vector<double> token_logprobs_of(causal_lm& m, const tensor& ids, const tensor& targets) {
  m.forward(ids, targets);
  const tensor logits = m.logits();
  owned_tensor scratch = empty({logits.size(0)}, logits.type(), logits.dev());
  return token_logprobs(logits, targets.reshape({ids.numel()}), scratch);
}

void backward_from_logprobs(causal_lm& m, const tensor& targets, std::span<const double> dlogp,
                            double loss_scale, const char* who) {
  const tensor logits = m.logits();
  const tensor flat = targets.reshape({targets.numel()});
  owned_tensor scratch = empty({1}, logits.type(), logits.dev());
  TROUPE_CHECK(m.set_logit_grads([&](const tensor& dlogits, double dloss) {
    std::vector<double> d(dlogp.begin(), dlogp.end());
    for (auto& x : d) x *= dloss;
    token_logprobs_backward(logits, flat, d, scratch, dlogits);
  }),
               who, ": the policy model cannot take the logits' gradient");
  m.backward(loss_scale);
  m.set_logit_grads({});
}

}  // namespace troupe::models
