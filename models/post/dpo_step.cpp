// dpo_step: DPO micro-batches on the trunk (dpo_step.hpp).
#include "models/post/dpo_step.hpp"

#include "memory/error.hpp"
#include "models/post/sequence_logprob.hpp"

namespace troupe::models {
namespace {

std::vector<double> logprobs_of(causal_lm& m, const tensor& ids, const tensor& targets,
                                bool average) {
  m.forward(ids, targets);
  const tensor logits = m.logits();
  owned_tensor scratch = empty({logits.size(0)}, logits.type(), logits.dev());
  return sequence_logprobs(logits, targets.reshape({ids.numel()}), ids.size(1), scratch,
                           {.average = average});
}

}  // namespace

double dpo_forward(causal_lm& policy, causal_lm& reference, const tensor& ids,
                   const tensor& targets, const dpo_options& opt, dpo_result& result,
                   std::vector<std::int64_t>& counts) {
  TROUPE_CHECK(ids.dim() == 2 && ids.size(0) % 2 == 0, "dpo: a batch is 2P rows [2P, T], got ",
               ids.sizes().str());
  const std::int64_t rows = ids.size(0), t = ids.size(1), pairs = rows / 2;
  const bool average = opt.type == dpo_loss_type::ipo;
  const std::vector<double> ref = logprobs_of(reference, ids, targets, average);
  const std::vector<double> pol = logprobs_of(policy, ids, targets, average);
  const auto p = static_cast<std::size_t>(pairs);
  auto half = [&](const std::vector<double>& v, std::size_t from) {
    return std::span<const double>(v).subspan(from, p);
  };
  result = dpo_loss(half(pol, 0), half(pol, p), half(ref, 0), half(ref, p), opt);
  counts.assign(static_cast<std::size_t>(rows), 0);
  const auto* tg = targets.data_as<std::int32_t>();
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t i = 0; i < t; ++i)
      counts[static_cast<std::size_t>(r)] += tg[r * t + i] != -100;
  return result.loss;
}

trainer::micro_batch dpo_micro_batch(std::shared_ptr<const preference_rows> rows,
                                     causal_lm& reference, std::int64_t pairs,
                                     const dpo_options& opt,
                                     std::function<void(const dpo_result&)> on_result) {
  struct buffers {
    std::vector<std::int32_t> ids, targets;
    std::vector<std::int64_t> counts;
    dpo_result result;
  };
  auto buf = std::make_shared<buffers>();
  return [rows, &reference, pairs, opt, on_result, buf](causal_lm& policy, std::uint64_t draw,
                                                        double loss_scale) {
    auto& b = *buf;
    preference_batch(*rows, static_cast<std::int64_t>(draw), pairs, b.ids, b.targets);
    const shape bt{2 * pairs, rows->seq};
    tensor ids(b.ids.data(), b.ids.size() * 4, dtype::i32, bt);
    tensor targets(b.targets.data(), b.targets.size() * 4, dtype::i32, bt);
    const double loss = dpo_forward(policy, reference, ids, targets, opt, b.result, b.counts);
    // d loss / d logp_b into the head's backward: S_b (summed cross-entropy) = -logp_b (times
    // count_b when logp_b is the average), so w_b = -d loss / d logp_b (/ count_b).
    std::vector<double> w(static_cast<std::size_t>(2 * pairs));
    for (std::size_t i = 0; i < w.size(); ++i) {
      const std::size_t p = i % static_cast<std::size_t>(pairs);
      const double d =
          i < static_cast<std::size_t>(pairs) ? b.result.d_chosen[p] : b.result.d_rejected[p];
      const double n = opt.type == dpo_loss_type::ipo ? static_cast<double>(b.counts[i]) : 1.0;
      w[i] = n == 0 ? 0.0 : -d / n;
    }
    TROUPE_CHECK(policy.set_sequence_weights(std::move(w)),
                 "dpo: the policy model cannot weight its sequences");
    policy.backward(loss_scale);
    policy.set_sequence_weights({});
    if (on_result) on_result(b.result);
    return loss;
  };
}

}  // namespace troupe::models
