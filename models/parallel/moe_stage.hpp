// moe_stage: one pipeline rank's part of an MoE model (models/moe.hpp: Mixtral, Qwen2-MoE),
// stage<moe_family> (stage.hpp) over the family's parts for placements: embed_tokens on virtual
// stage 0, the layers layers.<i> of each chunk (attention and the MoE layer whole, or with
// expert parallelism the rank's experts: moe_config::ep), norm and the head on the last virtual
// stage. Tensor parallelism of the MoE family is not written: tp_parts<moe_family>::checked refuses
// a group of more than one rank, naming parallel.tp.
//
// The router aux loss (moe.hpp: aux = n_expert * sum_e f_e P_e with f_e and P_e summed over every
// layer of the microbatch) is not a sum over layers, so no stage can add its share alone. The
// layers' statistics travel with the activations instead (stage_side<moe_family>): the boundary
// between virtual stages is [B + 1, T, C], the residual stream's B samples and one more whose bytes
// carry the totals so far, in f64 (rows, per expert the top-k choices and the probability sums of
// the layers before it). Each chunk adds its layers' statistics after its forward; the last virtual
// stage adds coef * aux of the totals to the loss (when the config's aux_loss is on, as the whole
// model does). The backward boundary's extra sample carries the totals' rows and choices back (the
// gradient of coef * aux in p[n, e] is coef * n_expert * f_e / M for every row of every layer,
// times the microbatch's weight), so every chunk sets its layers' aux_dprob before its backward.
// Per microbatch the aux loss is over that microbatch's rows, as the single-process trainer
// computes it per micro-batch of train.grad_accum. Each MoE layer's host state (routing,
// probabilities, statistics: moe_ffn::host_state) and the chunk's totals are kept per stash buffer
// with the activations, so a backward sees its own microbatch's routing.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "models/moe.hpp"
#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/stage.hpp"

namespace troupe::models {

// The MoE block on a placement: the whole block (tp = 1).
struct tp_moe_block : moe_block {
  tp_moe_block(const moe_config& c, tp_group) : moe_block(c) {}
};

// The embedding: Llama's.
struct tp_moe_front : tp_llama_front {
  tp_moe_front(const moe_config& c, tp_group g)
      : tp_llama_front(llama_config{.vocab = c.vocab, .dim = c.dim}, g) {}
};

template <>
struct tp_parts<moe_family> {
  using block = tp_moe_block;
  using front = tp_moe_front;
  using back = tp_head<rmsnorm>;
  static constexpr std::string_view token_scope = "embed_tokens";
  // The family's checks; a tensor-parallel group (tp > 1) is refused naming parallel.tp.
  static moe_config checked(const moe_config& c, const tp_group& tp, std::string_view who);
  static back::config head_config(const moe_config& c) {
    return {.dim = c.dim,
            .vocab = c.vocab,
            .norm = {.dim = c.dim, .eps = c.rms_eps},
            .tied = c.tie_embeddings};
  }
  static std::string_view head_scope(const moe_config&) { return "lm_head"; }
  static const attention& attention_of(const tp_moe_block& b) { return b.self_attn; }
  static scheduler::model_shape shape(const moe_config& c);
};

extern template class tp_trunk<moe_family>;

}  // namespace troupe::models

namespace troupe::models::parallel {

// The router statistics that travel with an MoE stage's activations (see the top of the file).
template <>
struct stage_side<moe_family> {
  // Rows, and per expert the top-k choices and the probability sums, over the layers so far.
  struct totals {
    double rows = 0;
    std::vector<double> selected, prob_sum;
  };

  stage_side(const moe_config& c, int chunks);
  // [B, T, C] -> [B + 1, T, C], checking the extra sample holds the totals.
  static shape boundary(const shape& rows, dtype type, const std::string& who);
  static tensor rows_of(const tensor& t) { return t.narrow(0, 0, t.size(0) - 1); }
  double forward(tp_trunk<moe_family>& trunk, block_span span, int chunk, const tensor& in,
                 const tensor& y);
  void backward(tp_trunk<moe_family>& trunk, block_span span, int chunk, const tensor& dy,
                const tensor& dx, double weight);
  void save(tp_trunk<moe_family>& trunk, block_span span, int chunk, std::size_t slot);
  void restore(tp_trunk<moe_family>& trunk, block_span span, int chunk, std::size_t slot);

  // The totals at the output of `chunk` for the microbatch whose activations are in the arena.
  const totals& live(int chunk) const { return live_[static_cast<std::size_t>(chunk)]; }

 private:
  struct kept {
    totals at;
    std::vector<moe_ffn::host_state> layers;
  };
  std::int32_t n_expert_;
  double coef_;
  bool with_aux_;
  std::vector<totals> live_;              // per chunk
  std::vector<std::vector<kept>> saved_;  // per chunk, per stash buffer
};

extern template class stage<moe_family>;
using moe_stage = stage<moe_family>;

// Expert parallelism (moe_config::ep > 1): every held MoE layer's group (not owned; must outlive
// the stage's use), as moe::set_expert_exchange.
void set_expert_exchange(moe_stage& s, moe_exchange* x);

}  // namespace troupe::models::parallel
