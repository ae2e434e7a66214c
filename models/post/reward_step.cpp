// reward_step: Bradley-Terry micro-batches of a reward model (reward_step.hpp).
#include "models/post/reward_step.hpp"

#include <vector>

#include "memory/error.hpp"

namespace troupe::models {

trainer::micro_batch reward_micro_batch(std::shared_ptr<const preference_rows> rows,
                                        reward_model& rm, std::int64_t pairs,
                                        std::function<void(const reward_result&)> on_result) {
  struct buffers {
    std::vector<std::int32_t> ids, targets;
  };
  auto buf = std::make_shared<buffers>();
  return [rows, &rm, pairs, on_result, buf](causal_lm& model, std::uint64_t draw,
                                            double loss_scale) {
    TROUPE_CHECK(&model == &rm.lm(), "reward model: the trainer must train the reward model's lm");
    auto& b = *buf;
    preference_batch(*rows, static_cast<std::int64_t>(draw), pairs, b.ids, b.targets);
    const tensor ids(b.ids.data(), b.ids.size() * 4, dtype::i32, {2 * pairs, rows->seq});
    const std::vector<double> r = rm.forward(ids);
    const auto p = static_cast<std::size_t>(pairs);
    const reward_result bt = bradley_terry_loss(std::span<const double>(r).subspan(0, p),
                                                std::span<const double>(r).subspan(p, p));
    std::vector<double> dr(bt.d_chosen);
    dr.insert(dr.end(), bt.d_rejected.begin(), bt.d_rejected.end());
    rm.backward(dr, loss_scale);
    if (on_result) on_result(bt);
    return bt.loss;
  };
}

}  // namespace troupe::models
