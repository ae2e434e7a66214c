// streamed_model: a model family's trunk (models/trunk.hpp: GPT-2, Llama) in the streamed
// placement of the memory tiers: run one UNIT at a time, so that a caller can bring a unit's
// parameters into memory right before it runs and take them away right after (ZeRO-Infinity
// parameter streaming).
//
// Units: 0 = the front (embeddings), 1..n_layer = the blocks, n_layer + 1 = the back (final norm,
// head - with a tied head, the front's token embedding too - and loss). A step is begin, then
// forward_unit(0..U-1), then backward_unit(U-1..0). The placement plans and owns the activations
// and scratch (memory::plan_memory over the slots' live intervals, as layer_memory does: with
// recompute, the blocks share one set of activation bytes) but NOT the parameters and gradients:
// before a unit runs, the caller binds the fields of that unit's parameter slots (and, for
// backward, their gradient fields) to memory it holds, e.g. chunks of a memory::tier_manager. The
// gradients accumulate (+=).
//
// What runs is the whole model's code (the same trunk<F>, blocks and ends; recompute included),
// so the results equal gpt's or llama's bit for bit. On the host, in f32 or bf16 (the dtype of
// every slot: the activations and scratch it plans, and the parameters and gradients the caller
// binds).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "memory/arena.hpp"
#include "models/gpt.hpp"
#include "models/hf/config.hpp"
#include "models/layers/slots.hpp"
#include "models/llama.hpp"
#include "models/moe.hpp"
#include "models/trunk.hpp"

namespace troupe::models {

class streamed_model {
 public:
  virtual ~streamed_model() = default;
  // Every slot; the parameter slots' fields (value and grad) are bound by the caller.
  virtual const slot_list& slots() const = 0;
  virtual std::int32_t units() const = 0;
  // Indices into slots().slots() of the parameters unit u reads, in slot order.
  virtual const std::vector<std::int32_t>& unit_params(std::int32_t u) const = 0;
  // Bytes of the planned activations and scratch: the model's non-model memory.
  virtual std::size_t non_model_bytes() const = 0;

  // ids, targets: i32 [B, T]; they must stay intact until the step's backward is done.
  virtual void begin(const tensor& ids, const tensor& targets) = 0;
  virtual void forward_unit(std::int32_t u) = 0;
  virtual double loss() const = 0;  // after the back's forward
  virtual void backward_unit(std::int32_t u, double loss_scale) = 0;
};

// Plans the slots of one kind (activations or scratch) as layer_memory does (dtype t, host) and
// binds them.
memory::arena bind_planned(const slot_list& slots, slot_kind kind, dtype t = dtype::f32);

// The streamed placement of trunk<F>.
template <trunk_family F>
class streamed final : public streamed_model {
 public:
  streamed(const typename F::config& cfg, batch_dims dims, dtype t = dtype::f32)
      : trunk_(cfg, dims, t),
        activations_(bind_planned(trunk_.slots(), slot_kind::activation, t)),
        scratch_(bind_planned(trunk_.slots(), slot_kind::scratch, t)) {}

  const slot_list& slots() const override { return trunk_.slots(); }
  std::int32_t units() const override { return trunk_.units(); }
  const std::vector<std::int32_t>& unit_params(std::int32_t u) const override {
    return trunk_.unit_params(u);
  }
  std::size_t non_model_bytes() const override {
    return activations_.capacity() + scratch_.capacity();
  }
  void begin(const tensor& ids, const tensor& targets) override { trunk_.begin(ids, targets); }
  void forward_unit(std::int32_t u) override { trunk_.forward_unit(u); }
  double loss() const override { return trunk_.loss(); }
  void backward_unit(std::int32_t u, double loss_scale) override {
    trunk_.backward_unit(u, loss_scale);
  }

 private:
  trunk<F> trunk_;
  memory::arena activations_, scratch_;
};

// t: f32 or bf16.
std::unique_ptr<streamed_model> make_streamed_model(const gpt_config& cfg, batch_dims dims,
                                                    dtype t = dtype::f32);
std::unique_ptr<streamed_model> make_streamed_model(const llama_config& cfg, batch_dims dims,
                                                    dtype t = dtype::f32);
std::unique_ptr<streamed_model> make_streamed_model(const moe_config& cfg, batch_dims dims,
                                                    dtype t = dtype::f32);
// The model an HF config describes (either family), with recompute per block or not.
std::unique_ptr<streamed_model> make_streamed_model(const hf::model_config& cfg, batch_dims dims,
                                                    bool recompute, dtype t = dtype::f32);

}  // namespace troupe::models
