// llama_stage: one pipeline rank's part of a Llama (models/llama.hpp), on the unsharded layers.
//
//   virtual stage 0:     x = embed_tokens[ids]
//   every chunk:         its layers layers.<first_block(c)> .. layers.<end_block(c) - 1>
//   last virtual stage:  logits = norm(x) @ lm_head^T; loss = mean cross-entropy. With
//                        tie_embeddings the head is embed_tokens: the last stage, when it is not
//                        stage 0, holds its own copy "embed_tokens.weight" (the runner sums its
//                        gradient with stage 0's).
//
// Parameter names are llama's. Tensor parallelism is not supported for Llama stages: a tp_group
// of more than one rank fails at construction. See pipeline_stage.hpp for the chunks, the memory
// and the activation stash.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "models/llama.hpp"
#include "models/parallel/pipeline_stage.hpp"

namespace troupe::models::parallel {

class llama_stage final : public pipeline_stage {
 public:
  // dims: the microbatch [rows, seq] every forward runs on. tp must have one rank (or none).
  llama_stage(const llama_config& cfg, batch_dims dims, const stage_options& o, tp_group tp = {});

  const llama_config& config() const { return cfg_; }  // n_kv_head and head_dim resolved

  void load_from(const slot_list& full, bool from_grads = false, bool to_grads = false) override;
  void load_from(const llama& full) { load_from(full.slots()); }
  void store_to(const slot_list& full, bool from_grads = false,
                bool to_grads = false) const override;
  void init_weights(std::uint64_t seed) override;

 private:
  double run_forward(int chunk, const tensor& in, const tensor& targets, const tensor& y) override;
  void run_backward(int chunk, const tensor& dy, const tensor& dx, double weight,
                    const block_hook& after_block) override;
  void save_extra(int chunk, std::size_t slot) override;
  void restore_extra(int chunk, std::size_t slot) override;
  bool replicated_over_tp(std::string_view) const override { return true; }
  void match(const slot_list& full, bool full_grads, bool own_grads, bool into_own) const;

  llama_config cfg_;
  bool first_ = false, last_ = false;
  embedding embed_tokens_;                       // virtual stage 0
  std::vector<std::unique_ptr<llama_block>> h_;  // by global index; null where not held
  rmsnorm norm_;                                 // last virtual stage
  linear lm_head_;                               // untied only
  cross_entropy_loss loss_;
  tensor head_w_, head_dw_;  // lm_head's, or (tied) embed_tokens' / the stage's own copy
  std::vector<tensor> x_;    // x_[i]: the input of layer i [B, T, C]; x_[n_layer]: of norm
  tensor norm_out_, logits_;
  tensor dx_a_, dx_b_;
  std::vector<std::int64_t> count_saved_;  // the loss's count per stash buffer
};

}  // namespace troupe::models::parallel
