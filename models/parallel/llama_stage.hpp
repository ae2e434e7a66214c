// llama_stage: one pipeline rank's part of a Llama (models/llama.hpp), built on the tensor-parallel
// Llama layers (tp_llama_layers.hpp), so a stage may also be a tensor shard (tp x pp, with or
// without SP); with tp_group{} (no communicator) the layers are the unsharded ones.
//
//   virtual stage 0:     x = embed_tokens[ids] (vocab parallel; SP: [B, T/tp, C])
//   every chunk:         its layers layers.<first_block(c)> .. layers.<end_block(c) - 1>
//                        (tp_llama_block)
//   last virtual stage:  logits = norm(x) @ lm_head^T on the shard's vocabulary rows; loss =
//                        vocab-parallel cross-entropy. With tie_embeddings the head is
//                        embed_tokens: the last stage, when it is not stage 0, holds its own copy
//                        "embed_tokens.weight" (the runner sums its gradient with stage 0's).
//
// Generation (step_chunk, pipeline_generation.hpp) runs the same pieces as tp_llama's: the
// embedding's shard at the new positions, each layer over its kv cache, the head on the last
// position.
//
// Parameter names and slicing are tp_llama's (parallelize_llama.hpp). See pipeline_stage.hpp for
// the chunks, the memory and the activation stash.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "models/llama.hpp"
#include "models/parallel/pipeline_stage.hpp"
#include "models/parallel/tp_llama_layers.hpp"
#include "models/parallel/tp_vocab.hpp"

namespace troupe::models::parallel {

class llama_stage final : public pipeline_stage {
 public:
  // dims: the microbatch [rows, seq] every forward runs on.
  llama_stage(const llama_config& cfg, batch_dims dims, const stage_options& o, tp_group tp = {});

  const llama_config& config() const { return cfg_; }  // n_kv_head and head_dim resolved

  void load_from(const slot_list& full, bool from_grads = false, bool to_grads = false) override;
  void load_from(const llama& full) { load_from(full.slots()); }
  void store_to(const slot_list& full, bool from_grads = false,
                bool to_grads = false) const override;
  void init_weights(std::uint64_t seed) override;
  void step_chunk(int chunk, const tensor& in, const tensor& y, std::int64_t start) override;

 private:
  double run_forward(int chunk, const tensor& in, const tensor& targets, const tensor& y) override;
  void run_backward(int chunk, const tensor& dy, const tensor& dx, double weight,
                    const block_hook& after_block) override;
  void save_extra(int chunk, std::size_t slot) override;
  void restore_extra(int chunk, std::size_t slot) override;

  llama_config cfg_;
  bool first_ = false, last_ = false;
  vocab_parallel_embedding embed_tokens_;           // virtual stage 0
  std::vector<std::unique_ptr<tp_llama_block>> h_;  // by global index; null if not held
  tp_llama_head head_;                              // last virtual stage
  std::vector<tensor> x_;  // x_[i]: the input of layer i [B, T_local, C]; x_[n_layer]: of norm
  tensor dx_a_, dx_b_;
  // Per stash buffer: the embedding's state (its ids' local rows) and the loss's count.
  std::vector<vocab_parallel_embedding> embed_saved_;
  std::vector<std::int64_t> count_saved_;
};

}  // namespace troupe::models::parallel
