// rmsnorm: y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) over the last dimension
// (Llama's RMSNorm).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct rmsnorm {
  struct config {
    std::int64_t dim = 0;
    double eps = 1e-6;
  };

  config cfg;
  std::string label = "rmsnorm";

  tensor weight, dweight;  // [dim]

  // Saved by forward for backward.
  tensor x;     // the input (a view of the caller's tensor)
  tensor rstd;  // per-row [rows] (planned; a forward uses a prefix)

  rmsnorm() = default;
  explicit rmsnorm(const config& c) : cfg(c) {}

  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);  // x, y [..., dim]
  void backward(const tensor& dy, const tensor& dx);
};

}  // namespace troupe::models
