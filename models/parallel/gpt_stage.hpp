// gpt_stage: one pipeline rank's part of a GPT-2 (models/gpt.hpp), built on the tensor-parallel
// layers (tp_layers.hpp, tp_vocab.hpp), so a stage may also be a tensor shard (tp x pp); with
// tp_group{} (no communicator) the layers are the unsharded ones.
//
//   virtual stage 0:     x = wte[ids] (vocab parallel; SP: [B, T/tp, C]) + wpe[positions]
//   every chunk:         its blocks h.<first_block(c)> .. h.<end_block(c) - 1> (tp_gpt_block)
//   last virtual stage:  logits = ln_f(x) @ wte^T (the stage's own copy of wte when it is not
//                        stage 0: "wte.weight", summed with stage 0's gradient by the runner);
//                        loss = vocab-parallel cross-entropy
//
// Generation (step_chunk, pipeline_generation.hpp) runs the same pieces as tp_gpt's: wte's shard
// and wpe at the new positions, each block over its kv cache, the tied head on the last position.
//
// Parameter names and layouts are tp_gpt's (declared with each parameter: param_slices.hpp); see
// pipeline_stage.hpp for the chunks, the memory and the activation stash. cfg.recompute: stashes
// keep the stage input only and a restored microbatch's chunk runs forward again before its
// backward (pipeline_stage.hpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "models/gpt.hpp"
#include "models/parallel/pipeline_stage.hpp"
#include "models/parallel/tp_layers.hpp"
#include "models/parallel/tp_vocab.hpp"

namespace troupe::models::parallel {

class gpt_stage final : public pipeline_stage {
 public:
  // dims: the microbatch [rows, seq] every forward runs on.
  gpt_stage(const gpt_config& cfg, batch_dims dims, const stage_options& o, tp_group tp = {});

  const gpt_config& config() const { return cfg_; }

  void load_from(const slot_list& full, bool from_grads = false, bool to_grads = false) override;
  void load_from(const gpt& full) { load_from(full.slots()); }
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

  gpt_config cfg_;
  std::int64_t seq_local_;        // T / tp with SP, else T
  std::int64_t seq_first_;        // the first position of the shard's rows (SP), else 0
  bool first_ = false;            // holds virtual stage 0 (chunk 0)
  bool last_ = false;             // holds the last virtual stage (chunk chunks() - 1)
  vocab_parallel_embedding wte_;  // virtual stage 0
  embedding wpe_;
  std::vector<std::unique_ptr<tp_gpt_block>> h_;  // by global index; null where not held
  sp_layernorm ln_f_;                             // last virtual stage
  tp_entry head_;
  vocab_parallel_cross_entropy loss_;
  tensor head_w_, head_dw_;  // the tied head: wte_'s on stage 0, else the stage's own copy
  owned_tensor pos_ids_;
  std::vector<tensor> x_;  // x_[i]: the input of block i [B, T_local, C]; x_[n_layer]: of ln_f
  tensor pos_emb_, ln_f_out_, logits_;
  tensor dx_a_, dx_b_, dpos_, dx0_full_, gather_buf_;
  // Per stash buffer: the embedding's state (its ids' local rows) and the loss's count.
  std::vector<vocab_parallel_embedding> wte_saved_;
  std::vector<std::int64_t> count_saved_;
};

}  // namespace troupe::models::parallel
