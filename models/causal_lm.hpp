// causal_lm: what the trainer, eval and generation need of a language model, so that one code
// path drives GPT-2 and Llama. The models themselves stay plain classes (models/gpt.hpp,
// models/llama.hpp); causal_lm_of<M> adapts one. make_causal_lm builds the model an HF config
// describes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "models/block_use.hpp"
#include "models/hf/config.hpp"
#include "models/layers/slots.hpp"
#include "models/token_objective.hpp"

namespace troupe::models {

class causal_lm {
 public:
  virtual ~causal_lm() = default;
  // ids, targets: i32 [B, T]; returns the mean loss over non-ignored targets.
  virtual double forward(const tensor& ids, const tensor& targets) = 0;
  // Accumulates d(loss_scale * loss)/d(params) into memory().grads() (loss_scale: f16 loss
  // scaling; 1 for the plain gradient).
  virtual void backward(double loss_scale = 1.0) = 0;
  // Makes backward call f(i) as soon as block i's parameter gradients are final (blocks in
  // reverse order; an empty f stops it). False when the model has no such point.
  virtual bool set_block_grads_hook(std::function<void(std::int64_t block)> f) {
    (void)f;
    return false;
  }
  // Makes forward and backward call f around every use of a block's parameters
  // (models/block_use.hpp; an empty f stops it). False when the model has no such points.
  virtual bool set_block_use_hook(block_use_hook f) {
    (void)f;
    return false;
  }
  // Packed rows for the forwards that follow (trunk::set_packing: segments and positions i32
  // [B, T]; undefined: one sequence per row). False when the model cannot take them.
  virtual bool set_packing(const tensor& segments, const tensor& positions) {
    (void)segments;
    (void)positions;
    return false;
  }
  // Per-sequence weights of the backwards that follow (trunk::set_sequence_weights; empty: the
  // mean loss). False when the model cannot take them.
  virtual bool set_sequence_weights(std::vector<double> w) {
    (void)w;
    return false;
  }
  // The logits' gradient for the backwards that follow (trunk::set_logit_grads). False when the
  // model cannot take it.
  virtual bool set_logit_grads(std::function<void(const tensor& dlogits, double dloss)> f) {
    (void)f;
    return false;
  }
  // A per-token objective for the forwards and backwards that follow (token_objective.hpp):
  // forward returns its loss, backward its gradient. Empty: the mean loss again. False when the
  // model does not take one itself (its caller then runs the objective on logits()).
  virtual bool set_token_objective(token_objective f) {
    (void)f;
    return false;
  }
  virtual tensor logits() const = 0;   // [B*T, V] of the last forward
  virtual layer_memory& memory() = 0;  // flat params / grads
  virtual const slot_list& slots() const = 0;
  virtual void init_weights(std::uint64_t seed) = 0;
  virtual void begin_generation(std::int64_t batch, std::int64_t capacity) = 0;
  virtual tensor step_logits(const tensor& ids) = 0;  // [B, V] of the last new position
  virtual std::int64_t vocab() const = 0;
  virtual std::int64_t max_seq() const = 0;
  // A line on the last forward's expert load (MoE models: each expert's top-k choices and the
  // choices dropped over capacity); empty for a dense model.
  virtual std::string load_line() const { return {}; }
};

// "expert choices 130 97 142 143 (of 512), dropped 0" of an MoE model's load (models/moe.hpp).
struct moe_load;
std::string describe_load(const moe_load& l);

template <class M>
class causal_lm_of final : public causal_lm {
 public:
  template <class... A>
  explicit causal_lm_of(A&&... a) : m_(std::forward<A>(a)...) {}
  M& model() { return m_; }
  // A model on a GPU takes host ids and targets too: they are copied to its device and kept until
  // the next call (backward reads the ids).
  double forward(const tensor& ids, const tensor& targets) override {
    const device dev = m_.memory().params().dev();
    if (dev.is_cpu() || !ids.is_cpu()) return m_.forward(ids, targets);
    ids_up_ = to_device(ids, dev);
    if (targets.data() == nullptr || !targets.is_cpu()) return m_.forward(ids_up_.view(), targets);
    targets_up_ = to_device(targets, dev);
    return m_.forward(ids_up_.view(), targets_up_.view());
  }
  void backward(double loss_scale) override { m_.backward(loss_scale); }
  bool set_block_grads_hook(std::function<void(std::int64_t block)> f) override {
    if constexpr (requires { m_.on_block_grads = std::move(f); }) {
      m_.on_block_grads = std::move(f);
      return true;
    } else {
      return false;
    }
  }
  bool set_block_use_hook(block_use_hook f) override {
    if constexpr (requires { m_.on_block_use = std::move(f); }) {
      m_.on_block_use = std::move(f);
      return true;
    } else {
      return false;
    }
  }
  bool set_packing(const tensor& segments, const tensor& positions) override {
    if constexpr (requires { m_.set_packing(segments, positions); }) {
      m_.set_packing(segments, positions);
      return true;
    } else {
      return false;
    }
  }
  bool set_sequence_weights(std::vector<double> w) override {
    if constexpr (requires { m_.set_sequence_weights(std::move(w)); }) {
      m_.set_sequence_weights(std::move(w));
      return true;
    } else {
      return false;
    }
  }
  bool set_logit_grads(std::function<void(const tensor&, double)> f) override {
    if constexpr (requires { m_.set_logit_grads(std::move(f)); }) {
      m_.set_logit_grads(std::move(f));
      return true;
    } else {
      return false;
    }
  }
  bool set_token_objective(token_objective f) override {
    if constexpr (requires { m_.set_token_objective(std::move(f)); }) {
      m_.set_token_objective(std::move(f));
      return true;
    } else {
      return false;
    }
  }
  tensor logits() const override { return m_.logits(); }
  layer_memory& memory() override { return m_.memory(); }
  const slot_list& slots() const override { return m_.slots(); }
  void init_weights(std::uint64_t seed) override { m_.init_weights(seed); }
  void begin_generation(std::int64_t batch, std::int64_t capacity) override {
    m_.begin_generation(batch, capacity);
  }
  tensor step_logits(const tensor& ids) override {
    const device dev = m_.memory().params().dev();
    if (dev.is_cpu() || !ids.is_cpu()) return m_.step_logits(ids);
    ids_up_ = to_device(ids, dev);
    return m_.step_logits(ids_up_.view());
  }
  std::int64_t vocab() const override { return m_.config().vocab; }
  std::int64_t max_seq() const override { return m_.config().max_seq; }
  std::string load_line() const override {
    if constexpr (requires { m_.load(); })
      return describe_load(m_.load());
    else
      return {};
  }

 private:
  M m_;
  owned_tensor ids_up_, targets_up_;  // host inputs copied to a GPU model's device
};

// How a model is built beyond what its HF config says.
struct model_options {
  bool recompute = false;  // activation checkpointing per block (gpt_config / llama_config)
};

// The model settings of an HF Llama config (models/llama.hpp). With dynamic rope_scaling, max_seq
// is factor x max_position_embeddings (HF sets no limit) and the threshold of the scaling is
// max_position_embeddings, as in HF.
struct llama_config;
llama_config to_llama_config(const hf::llama_config& c);

// The model settings of an HF Mixtral or Qwen2-MoE config (models/moe.hpp).
struct moe_config;
moe_config to_moe_config(const hf::moe_config& c);

// The model of an HF config, planned for batches of `dims`.
std::unique_ptr<causal_lm> make_causal_lm(const hf::model_config& cfg, batch_dims dims,
                                          dtype t = dtype::f32, device dev = device::cpu(),
                                          const model_options& opts = {});

// Named sizes built from scratch: "gpt2-demo" (4 x 128, byte vocabulary), "gpt2-small" (124M),
// "bench-small" (6 x 384, vocabulary 8192), "llama-tiny" (4 x 128, GQA 4:2, byte vocabulary),
// "mixtral-tiny" (4 x 128, 4 experts top-2 of width 176, byte vocabulary, the aux loss on). vocab >
// 0 overrides the vocabulary (e.g. the tokenizer's). Errors list the known names.
expected<hf::model_config> named_model_config(std::string_view name, std::int64_t vocab = 0);

}  // namespace troupe::models
