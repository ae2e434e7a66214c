// swiglu_mlp: the Llama feed-forward block, y = down_proj(silu(gate_proj(x)) * up_proj(x)).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/layers/linear.hpp"
#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct swiglu_mlp {
  struct config {
    std::int64_t dim = 0;     // model width C
    std::int64_t hidden = 0;  // intermediate size
    bool bias = false;        // gate_proj and up_proj (HF's mlp_bias)
    bool out_bias = false;    // down_proj (HF's mlp_bias; a tensor shard adds it after reducing)
  };

  config cfg;
  std::string label = "swiglu_mlp";

  linear gate_proj;  // C -> hidden (saves x)
  linear up_proj;    // C -> hidden (saves x)
  linear down_proj;  // hidden -> C (saves a)

  // Saved by forward for backward (planned [rows, hidden]; a forward uses a prefix).
  tensor gate, up;  // gate_proj(x), up_proj(x), read by the SwiGLU backward
  tensor a;         // silu(gate) * up, the input of down_proj

  // Scratch, used inside backward only.
  tensor da, dgate, dup;

  swiglu_mlp() = default;
  explicit swiglu_mlp(const config& c)
      : cfg(c),
        gate_proj({c.dim, c.hidden, c.bias, tp_split::column}),
        up_proj({c.dim, c.hidden, c.bias, tp_split::column}),
        down_proj({c.hidden, c.dim, c.out_bias, tp_split::row, {}, /*residual_out=*/true}) {}

  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);  // x, y [..., dim]
  void backward(const tensor& dy, const tensor& dx);
};

}  // namespace troupe::models
