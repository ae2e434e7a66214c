// mlp: the GPT-2 feed-forward block, y = proj(gelu_tanh(fc(x))).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/layers/linear.hpp"
#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct mlp {
  struct config {
    std::int64_t dim = 0;     // model width C
    std::int64_t hidden = 0;  // usually 4 C
    bool bias = true;
  };

  config cfg;
  std::string label = "mlp";

  linear fc;    // C -> hidden (saves x)
  linear proj;  // hidden -> C (saves a)

  // Saved by forward for backward (planned [rows, hidden]; a forward uses a prefix).
  tensor h;  // fc(x), read by the GELU backward
  tensor a;  // gelu(h), the input of proj

  // Scratch, used inside backward only.
  tensor da, dh;

  mlp() = default;
  explicit mlp(const config& c)
      : cfg(c),
        fc({c.dim, c.hidden, c.bias, tp_split::column}),
        proj({c.hidden, c.dim, c.bias, tp_split::row, {}, /*residual_out=*/true}) {}

  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);  // x, y [..., dim]
  void backward(const tensor& dy, const tensor& dx);
};

}  // namespace troupe::models
