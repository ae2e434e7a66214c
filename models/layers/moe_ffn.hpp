// moe_ffn: a sparse mixture-of-experts feed-forward layer with HF semantics (transformers 4.44's
// MixtralSparseMoeBlock and Qwen2MoeSparseMoeBlock), forward and backward.
//
//   logits = x gate^T                      the router, [rows, n_expert]
//   p = softmax(logits)                    per token, in the model's precision (f32 as HF's)
//   route: top_k experts by p, weights w (renormalised when norm_topk_prob)   moe_routing.hpp
//   y = sum over the chosen experts e of w_e * expert_e(x)     each expert a swiglu_mlp
//     + sigmoid(shared_expert_gate(x)) * shared_expert(x)      Qwen2-MoE only (shared_hidden > 0)
//
// Backward is exact through the routing weights (d w -> d p through the renormalisation -> d
// logits through the softmax -> the router) and adds aux_dprob, the gradient of the model's load
// balancing loss in p (set by the model before backward; moe.hpp), to every token's d p. The
// top-k choice itself is piecewise constant and has no gradient, as in HF.
//
// The load statistics of the last forward: routing.selected (per expert, the top-k choices of
// it), routing.dropped (choices over capacity), prob_sum (per expert, the sum of p over the rows).
//
// Parameters: gate.weight [n_expert, C] (replicated), experts.<e>.{gate,up,down}_proj.weight
// (each declared under slot_list::mark_expert(e): param_spec::expert = e), and with a shared
// expert shared_expert.{gate,up,down}_proj.weight and shared_expert_gate.weight [1, C].
//
// Every expert's buffers are planned for its capacity: all rows (dropless: a token picks an
// expert at most once) or ceil(capacity_factor * rows * top_k / n_expert). Dispatch and combine
// move rows through the op API one by one, so the layer runs on any device; the router's
// probabilities are read on the host for the routing decision.
//
// Expert parallelism (config::ep > 1, moe_dispatch.hpp): the layer holds only experts
// [ep_rank * n_expert / ep, (ep_rank + 1) * n_expert / ep) (experts[j] is expert first_expert() +
// j, its parameters still named experts.<global index>), and forward and backward exchange rows
// with the group through `exchange` (set before the first forward). Dropless only: a local
// expert's buffers hold ep x rows (each rank sends it a token at most once). The router, the
// routing decision, the shared expert, the weighting and the accumulation into y and dx run on
// each rank's own tokens in the single process's order; only which rank runs an expert changes.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "models/layers/linear.hpp"
#include "models/layers/moe_dispatch.hpp"
#include "models/layers/moe_routing.hpp"
#include "models/layers/slots.hpp"
#include "models/layers/swiglu_mlp.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct moe_ffn {
  struct config {
    std::int64_t dim = 0;     // model width C
    std::int64_t hidden = 0;  // each expert's intermediate size
    std::int32_t n_expert = 0;
    std::int32_t top_k = 0;
    bool norm_topk_prob = true;      // Mixtral: always; Qwen2-MoE: its config's norm_topk_prob
    std::int64_t shared_hidden = 0;  // the shared expert's intermediate size (0: none)
    double capacity_factor = 0;      // 0: dropless
    std::int32_t ep = 1;             // expert-parallel degree (divides n_expert)
    std::int32_t ep_rank = 0;        // this rank's place in the expert-parallel group
  };

  config cfg;
  std::string label = "moe_ffn";

  linear gate;                      // C -> n_expert, the router
  std::vector<swiglu_mlp> experts;  // the local ones: n_expert / ep of them
  swiglu_mlp shared_expert;         // shared_hidden > 0
  linear shared_expert_gate;        // C -> 1

  // Activations: router logits and probabilities [rows, n_expert]; each expert's input and
  // output rows [capacity, C]; the shared expert's output [rows, C] and gate logit [rows, 1].
  tensor logits, probs;
  std::vector<tensor> expert_in, expert_out;
  tensor shared_out, shared_logit;
  // Scratch (backward).
  tensor dexpert_out, dexpert_in, dprobs, dlogits, drow, dshared, dshared_x, dshared_logit;

  // The last forward's routing and statistics (see the top of the file).
  moe_routing routing;
  std::vector<double> prob_sum;
  // d(loss)/d p[n, e] added for every token n (the load balancing loss); empty: none.
  std::vector<double> aux_dprob;

  // Expert parallelism: the group (set by the model; not owned), the rows the last forward's
  // local experts served (from every rank of the group; with ep 1 routing.experts' sizes), the
  // rows each rank sent to each local expert ([source rank][local expert]), and the staging:
  // ep_out (activation) the expert outputs returned to this rank, expert by expert; ep_send,
  // ep_recv the rows on their way out and in.
  moe_exchange* exchange = nullptr;
  std::vector<std::int64_t> served;
  std::vector<std::int64_t> received;
  tensor ep_out, ep_send, ep_recv;

  moe_ffn() = default;
  explicit moe_ffn(const config& c);
  moe_ffn(const moe_ffn&) = delete;  // the slots point into it
  moe_ffn& operator=(const moe_ffn&) = delete;
  moe_ffn(moe_ffn&&) = default;

  // What backward reads outside the arena (the routing, the probabilities and shared gates on the
  // host, the statistics and the exchange's counts, and the local experts' saved input views,
  // whose rows vary with the routing): a pipeline stage keeps one per microbatch in flight
  // (models/parallel/moe_stage.hpp) and puts it back before that microbatch's backward.
  struct host_state {
    moe_routing routing;
    std::vector<double> prob_sum, p, sigmoid;
    std::vector<std::int64_t> served, received;
    std::int64_t rows = 0;
    std::vector<tensor> expert_inputs;  // per local expert: gate_proj's, up_proj's, down_proj's x
  };
  host_state save() const;
  void restore(const host_state& s);

  // An expert's rows for a batch of `rows` tokens.
  std::int64_t capacity(std::int64_t rows) const;
  // The first local expert's global index, and how many the layer holds.
  std::int32_t first_expert() const { return cfg.ep_rank * local_experts(); }
  std::int32_t local_experts() const { return cfg.ep > 0 ? cfg.n_expert / cfg.ep : 0; }

  void declare(slot_list& s, std::string_view name, batch_dims b);
  void forward(const tensor& x, const tensor& y);  // x, y [..., dim]
  // dx must not alias dy.
  void backward(const tensor& dy, const tensor& dx);

 private:
  std::vector<double> p_;        // the last forward's probabilities on the host
  std::vector<double> sigmoid_;  // sigmoid(shared_logit) per row
  std::int64_t rows_ = 0;

  // The routed experts of one forward and backward: in this process (ep 1), or over the group.
  void experts_forward(const tensor& xr, const tensor& yr);
  void experts_backward(const tensor& dyr, const tensor& dxr, const tensor& tmp,
                        std::vector<double>& dweight);
  void ep_forward(const tensor& xr, const tensor& yr);
  void ep_backward(const tensor& dyr, const tensor& dxr, const tensor& tmp,
                   std::vector<double>& dweight);
  // Rows per peer of the send side (expert-major, peer p's experts consecutive) and of the receive
  // side (source-major), from routing and `received`.
  std::vector<std::int64_t> send_rows() const;
  std::vector<std::int64_t> recv_rows() const;
  // Local expert j's rows in ep_recv: from source s at recv_offset(s, j), received[s * L + j] of
  // them.
  std::int64_t recv_offset(int s, std::int32_t j) const;
  // Local expert j's rows between the receive layout `recv` and its own contiguous rows `dense`:
  // gathered into dense (to_dense), else scattered back into recv.
  void move_expert_rows(std::int32_t j, const tensor& recv, const tensor& dense,
                        bool to_dense) const;
};

}  // namespace troupe::models
