// model_producer: a causal_lm as a grad_producer (see model_producer.hpp).
#include "models/parallel/model_producer.hpp"

#include "models/parallel/param_slices.hpp"

namespace troupe::models::parallel {

model_producer::model_producer(causal_lm& model) : model_(model) {}

model_producer::model_producer(causal_lm& shard, collective::communicator& tp)
    : model_(shard), tp_(&tp) {}

model_producer::~model_producer() {
  if (hook_ || mb_hook_) model_.set_block_grads_hook({});
}

double model_producer::forward_backward(int microbatches,
                                        const std::function<microbatch_data(int k)>& fetch) {
  double loss = 0;
  for (int k = 0; k < microbatches; ++k) {
    microbatch_data mb = fetch(k);
    loss += mb.weight * model_.forward(mb.ids, mb.targets);
    k_ = k;
    last_ = k + 1 == microbatches;
    try {
      model_.backward(mb.weight);  // the gradient of weight * loss
    } catch (...) {
      last_ = false;
      throw;
    }
    last_ = false;
    if (mb_hook_) mb_hook_(k, -1);
  }
  return loss;
}

bool model_producer::install_grads_hook() {
  if (!hook_ && !mb_hook_) return model_.set_block_grads_hook({});
  return model_.set_block_grads_hook([this](std::int64_t block) {
    if (mb_hook_) mb_hook_(k_, block);
    if (last_ && hook_) hook_(block);
  });
}

bool model_producer::set_block_grads_hook(std::function<void(std::int64_t block)> f) {
  hook_ = std::move(f);
  return install_grads_hook();
}

bool model_producer::set_microbatch_grads_hook(std::function<void(int k, std::int64_t block)> f) {
  mb_hook_ = std::move(f);
  const bool ok = install_grads_hook();
  if (!ok) mb_hook_ = {};
  return ok;
}

bool model_producer::counts_in_norm(const tensor_slot& parameter) const {
  return tp_ == nullptr || tp_->rank() == 0 || !replicated_over_tp(parameter);
}

}  // namespace troupe::models::parallel
