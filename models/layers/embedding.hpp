// embedding: y[..., C] = table[ids[...]], the token (or position) embedding.
//
// Backward scatters dy into dweight (accumulated); ids have no gradient. For weight tying (GPT-2's
// lm_head) a model assigns this layer's weight and dweight to the linear's fields after binding.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct embedding {
  struct config {
    std::int64_t vocab = 0;
    std::int64_t dim = 0;
    // Under tensor parallelism the rows (the vocabulary) are split across the group (a token
    // embedding, also a tied head); false: replicated (GPT-2's positions).
    bool split_vocab = true;
  };

  config cfg;
  std::string label = "embedding";

  tensor weight, dweight;  // [vocab, dim]

  // Saved by forward for backward.
  tensor ids;  // a view of the caller's ids (i32 or i64), which must stay intact until backward

  embedding() = default;
  explicit embedding(const config& c) : cfg(c) {}

  void declare(slot_list& s, std::string_view name, batch_dims b = {});
  // ids [...] -> y [..., dim].
  void forward(const tensor& ids, const tensor& y);
  // dweight += the rows of dy scattered by ids.
  void backward(const tensor& dy);
};

}  // namespace troupe::models
