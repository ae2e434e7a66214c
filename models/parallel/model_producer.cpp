// model_producer: a causal_lm as a grad_producer (see model_producer.hpp).
#include "models/parallel/model_producer.hpp"

#include <map>
#include <memory>

#include "memory/error.hpp"

namespace troupe::models::parallel {

model_producer::model_producer(causal_lm& model) : model_(model) {}

model_producer::model_producer(causal_lm& shard, collective::communicator& tp,
                               std::function<bool(std::string_view)> replicated)
    : model_(shard), tp_(&tp), replicated_(std::move(replicated)) {
  TROUPE_CHECK(replicated_ != nullptr, "model_producer: the tensor-parallel shard on rank ",
               tp.rank(), " of ", tp.name(), " needs a predicate for its replicated parameters");
}

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

bool model_producer::counts_in_norm(std::string_view parameter) const {
  return tp_ == nullptr || tp_->rank() == 0 || !replicated_(parameter);
}

std::function<bool(std::string_view)> replicated_by_shape(const slot_list& shard,
                                                          const slot_list& full) {
  std::map<std::string, shape, std::less<>> full_shapes;
  for (const auto& s : full.slots())
    if (s.kind == slot_kind::param) full_shapes.emplace(s.name, s.sizes);
  auto replicated = std::make_shared<std::set<std::string, std::less<>>>();
  for (const auto& s : shard.slots()) {
    if (s.kind != slot_kind::param) continue;
    auto it = full_shapes.find(s.name);
    TROUPE_CHECK(it != full_shapes.end(),
                 "replicated_by_shape: the unsharded model has no "
                 "parameter '",
                 s.name, "'");
    if (it->second == s.sizes) replicated->insert(s.name);
  }
  return [replicated](std::string_view name) { return replicated->count(name) > 0; };
}

}  // namespace troupe::models::parallel
