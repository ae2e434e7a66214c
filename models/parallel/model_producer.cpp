// model_producer: a causal_lm as a grad_producer (see model_producer.hpp).
#include "models/parallel/model_producer.hpp"

#include "memory/error.hpp"
#include "models/parallel/param_slices.hpp"
#include "models/parallel/vocab_entropy.hpp"
#include "models/post/policy_logprobs.hpp"

namespace troupe::models::parallel {

namespace {

// A microbatch's packing and objective on the model for its forward and backward, taken off
// again at the end. An objective the model does not take itself (the whole causal_lm: it has
// no vocab-parallel head) runs on its logits (models/post/policy_logprobs.hpp), as the
// single-process post-training steps do.
class microbatch_inputs {
 public:
  microbatch_inputs(causal_lm& m, const microbatch_data& mb, bool shard) : m_(m), mb_(mb) {
    if (mb.segments.defined()) {
      TROUPE_CHECK(m.set_packing(mb.segments, mb.positions),
                   "model_producer: ", shard ? "a tensor shard" : "this model",
                   " cannot run packed rows (segments) yet: one sequence per row");
      packed_ = true;
    }
    if (mb.objective) own_ = m.set_token_objective(mb.objective);
  }
  ~microbatch_inputs() {
    if (packed_) m_.set_packing(tensor{}, tensor{});
    if (own_) m_.set_token_objective({});
  }
  microbatch_inputs(const microbatch_inputs&) = delete;
  microbatch_inputs& operator=(const microbatch_inputs&) = delete;

  double forward() {
    if (!mb_.objective || own_) return m_.forward(mb_.ids, mb_.targets);
    result_ = mb_.objective(token_logprobs_of(m_, mb_.ids, mb_.targets));
    if (result_.on_entropy) result_.on_entropy(vocab_parallel_entropy(m_.logits(), {}));
    return result_.loss;
  }
  void backward(double weight) {
    if (!mb_.objective || own_) return m_.backward(weight);
    backward_from_logprobs(m_, mb_.targets, result_.dlogp, weight, "model_producer");
  }

 private:
  causal_lm& m_;
  const microbatch_data& mb_;
  bool packed_ = false, own_ = false;
  token_loss result_;
};

}  // namespace

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
    microbatch_inputs in(model_, mb, tp_ != nullptr);
    loss += mb.weight * in.forward();
    k_ = k;
    last_ = k + 1 == microbatches;
    try {
      in.backward(mb.weight);  // the gradient of weight * loss
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
