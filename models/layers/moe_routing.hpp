// moe_routing: which expert each token goes to, and the two data movements of an MoE layer,
// dispatch (token rows -> each expert's input rows) and combine (each expert's output rows,
// weighted -> token rows), each written beside its conjugate (the backward of one is the other's
// shape: combine's backward dispatches the weighted gradient, dispatch's backward combines the
// experts' input gradients unweighted).
//
// These move rows between one process's tokens and experts. Under expert parallelism
// (moe_dispatch.hpp) they fill and drain the staging of the all-to-alls instead (expert-major rows
// out, the returned rows combined); the routing decision (route_tokens) and the experts stay as
// they are.
//
// The decision follows HF's MixtralSparseMoeBlock / Qwen2MoeSparseMoeBlock (transformers 4.44):
// p = softmax(router logits) per token, the top_k experts by p (ties to the lower index), their
// weights p (renormalised to sum 1 when norm_topk_prob: Mixtral always, Qwen2-MoE by its config).
// Dropless by default (every choice is served); with a capacity (an expert's most rows), the
// top-1 choices of all tokens are served first, then the top-2 choices, ... in token order, and
// choices beyond an expert's capacity are dropped (they contribute nothing; the token keeps its
// residual) and counted.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::models {

struct moe_assignment {
  std::int64_t row = 0;     // the token's row of x [rows, C]
  std::int32_t choice = 0;  // 0 for its first choice, ... top_k - 1
  double weight = 0;        // its routing weight (renormalised or not)
};

struct moe_routing {
  std::int64_t rows = 0;
  std::int32_t top_k = 0;
  // Per expert, the rows it serves in the order of its input rows.
  std::vector<std::vector<moe_assignment>> experts;
  // Per token and choice (rows x top_k): the expert chosen and its weight, dropped or not.
  std::vector<std::int32_t> chosen;
  std::vector<double> weights;
  // Per expert: the choices of it (before the capacity), the load statistics.
  std::vector<std::int64_t> selected;
  std::int64_t dropped = 0;  // choices beyond an expert's capacity
};

// The routing of `rows` tokens by their probabilities p (rows x n_expert, row-major) among
// n_expert experts; capacity 0: dropless. `round` rounds a weight to the model's precision.
moe_routing route_tokens(const std::vector<double>& p, std::int64_t rows, std::int32_t n_expert,
                         std::int32_t top_k, bool norm_topk_prob, std::int64_t capacity,
                         double (*round)(double));

// Expert e's input rows: in[j] = x[rows of its j-th assignment]; in [>= count, C].
void dispatch(const moe_routing& r, std::int32_t e, const tensor& x, const tensor& in);
// Its conjugate: dx[row] += din[j] for each of expert e's assignments.
void dispatch_backward(const moe_routing& r, std::int32_t e, const tensor& din, const tensor& dx);

// y[row] += weight * out[j] for each of expert e's assignments.
void combine(const moe_routing& r, std::int32_t e, const tensor& out, const tensor& y);
// Its conjugate: dout[j] = weight * dy[row]; returns d(weight) of each assignment, <dy[row],
// out[j]>. tmp: one row [C] of scratch.
std::vector<double> combine_backward(const moe_routing& r, std::int32_t e, const tensor& dy,
                                     const tensor& out, const tensor& dout, const tensor& tmp);

}  // namespace troupe::models
