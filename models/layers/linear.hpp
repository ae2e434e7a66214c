// linear: y = x W^T + b, with W [out, in] as in torch nn.Linear.
//
// (HF GPT-2 stores Conv1D weights as [in, out]; transposing them is a load-time concern.)
// Gradients: dx = dy W (overwritten, or added with accumulate_dx), dW += dy^T x, db +=
// sum_rows(dy). Under a deferred_weight_grads scope (weight_grads.hpp) backward computes dx only
// and queues dW and db.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

// How a tensor-parallel group splits a linear layer (declared on its parameters, param_spec):
// column-parallel (Megatron) splits W's rows and the bias, row-parallel W's columns (the bias is
// then replicated, added once after the reduction); none replicates both.
enum class tp_split : std::uint8_t { none, column, row };

struct linear {
  struct config {
    std::int64_t in = 0;
    std::int64_t out = 0;
    bool bias = true;
    tp_split split = tp_split::none;
    // column: sections of `out` split separately (fused q, k, v rows); empty: one.
    std::vector<std::int64_t> sections = {};
    bool residual_out = false;  // writes into the residual stream (param_spec::residual_out)
  };

  config cfg;
  std::string label = "linear";  // names the layer in errors, e.g. "linear 'h.0.mlp.fc'"

  // Parameters and their gradients (accumulated).
  tensor weight, bias;  // [out, in], [out] (undefined without bias)
  tensor dweight, dbias;

  // Saved by forward for backward.
  tensor x;  // the input: a view of the caller's tensor, which must stay intact until backward

  linear() = default;
  explicit linear(const config& c) : cfg(c) {}

  // Declares weight (and bias) under `name`. A linear has no activations of its own.
  void declare(slot_list& s, std::string_view name, batch_dims b = {});

  // x [..., in] -> y [..., out]; both contiguous.
  void forward(const tensor& x, const tensor& y);
  // dy [..., out] -> dx [..., in] (dx may be undefined when not needed).
  void backward(const tensor& dy, const tensor& dx, bool accumulate_dx = false);
};

}  // namespace troupe::models
