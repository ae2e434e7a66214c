// layernorm: y = (x - mean) * rstd * w + b over the last dimension (torch nn.LayerNorm).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct layernorm {
  struct config {
    std::int64_t dim = 0;
    double eps = 1e-5;
    bool bias = true;
  };

  config cfg;
  std::string label = "layernorm";

  tensor weight, bias;  // [dim], [dim] (undefined without bias)
  tensor dweight, dbias;

  // Saved by forward for backward.
  tensor x;           // the input (a view of the caller's tensor)
  tensor mean, rstd;  // per-row statistics [rows] (planned; a forward uses a prefix)

  layernorm() = default;
  explicit layernorm(const config& c) : cfg(c) {}

  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);  // x, y [..., dim]
  void backward(const tensor& dy, const tensor& dx);
};

}  // namespace troupe::models
