// model_producer: a grad_producer (grad_producer.hpp) over a whole causal_lm, or over a
// tensor-parallel shard of one (causal_lm_of<tp_gpt>): the step's microbatches run one after the
// other, forward then backward of weight_k * loss_k, and the model's block hook reaches the engine
// during the last microbatch's backward only (when a block's gradients are final); the microbatch
// grads hook and the block use hook reach it in every microbatch.
//
// Gradient norm of a tensor-parallel shard: the norm group is the tp communicator and a parameter
// is counted on every shard when it is sharded (each shard holds a disjoint slice) but on tp rank 0
// only when it is replicated (every shard holds the whole tensor and, after backward, the same
// gradient: LayerNorms, wpe, row-parallel biases), as each parameter's declaration says
// (param_spec, models/layers/slots.hpp).
#pragma once

#include <functional>
#include <string>
#include <utility>

#include "models/causal_lm.hpp"
#include "models/parallel/grad_producer.hpp"

namespace troupe::models::parallel {

class model_producer final : public grad_producer {
 public:
  // A whole model: no norm group, every parameter counted.
  explicit model_producer(causal_lm& model);
  // A tensor-parallel shard: the norm is summed over `tp`; replicated parameters count on tp
  // rank 0 only.
  model_producer(causal_lm& shard, collective::communicator& tp);
  ~model_producer() override;
  model_producer(const model_producer&) = delete;
  model_producer& operator=(const model_producer&) = delete;

  causal_lm& model() { return model_; }
  layer_memory& memory() override { return model_.memory(); }
  const slot_list& slots() const override { return model_.slots(); }
  double forward_backward(int microbatches,
                          const std::function<microbatch_data(int k)>& fetch) override;
  bool set_block_grads_hook(std::function<void(std::int64_t block)> f) override;
  bool set_microbatch_grads_hook(std::function<void(int k, std::int64_t block)> f) override;
  bool set_block_use_hook(block_use_hook f) override {
    return model_.set_block_use_hook(std::move(f));
  }
  collective::communicator* norm_group() override { return tp_; }
  bool counts_in_norm(const tensor_slot& parameter) const override;

 private:
  causal_lm& model_;
  collective::communicator* tp_ = nullptr;
  bool install_grads_hook();  // the model's hook, serving hook_ and mb_hook_
  std::function<void(std::int64_t)> hook_;
  std::function<void(int, std::int64_t)> mb_hook_;
  int k_ = 0;          // the microbatch whose backward is running
  bool last_ = false;  // the last microbatch's backward is running
};

}  // namespace troupe::models::parallel
