// Context parallelism, Ulysses mode (parallel.cp > 1, parallel.cp_mode = "ulysses"): the sequence
// of every sample split over the cp ranks of a group, each rank holding T/cp consecutive positions
// through embeddings, norms, MLP, head and loss, and every position of H/cp heads inside attention
// (DeepSpeed-Ulysses, Jacobs et al. 2023).
//
//   ulysses_exchange   the all-to-all of models/layers/sequence_exchange.hpp over a communicator:
//                      [B, T/cp, H, D] <-> [B, T, H/cp, D] per head section (q | k | v), with the
//                      buffers the attention needs beyond its planned slots (one per layer for the
//                      attention output it keeps for backward).
//   cp_piece           a grad_producer (grad_producer.hpp) over a whole model (gpt, llama) planned
//                      for [rows, T/cp]: every parameter whole on every rank, its attention layers
//                      attached to exchanges, positions offset by cp_rank x T/cp (GPT-2's learned
//                      positions; RoPE rotates after the exchange, at 0..T-1).
//
// The step. dp_trainer hands every cp rank of a data-parallel replica the same rows [rows, T] with
// their next-token targets; the piece keeps its T/cp columns of both. Its loss is the mean over its
// own targets, so the sample's mean over all T (HF's, and the single process's) is the sum over
// the ranks of (n_r / N) x each rank's mean, n_r this rank's counted targets, N the whole rows'
// (both read from the full targets: no collective). The piece runs backward of weight x n_r / N x
// its loss and returns weight x n_r / N x its loss: its share. The engine's group is dp x cp (every
// rank of the job holding the whole model: dp_trainer's `cp`), whose gradient reduction sums the
// shares over cp and dp, as its loss allreduce sums the losses: so no collective of the piece
// touches the gradients, and ZeRO shards over dp x cp ranks. Replicated parameters thus need no
// norm group; every rank counts every parameter.
//
// Composition: dp x cp here, and dp x cp x pp with the same exchanges and ring inside pipeline
// stages (context_pipeline.hpp); not with tp (refused by scheduler::validate naming parallel.tp);
// f32, bf16 and f16 models.
//
// Ring mode (parallel.cp_mode = "ring"): the same piece, each rank holding the zigzag pieces of
// every sample (models/layers/sequence_split.hpp: chunks r and 2 cp - 1 - r of 2 cp, so T must
// divide by 2 cp) through the whole block, heads included; the attention core runs ring attention
// over the cp ranks (ring_context.hpp, models/layers/ring_attention.hpp), RoPE and GPT-2's learned
// positions read the pieces' global positions (trunk::set_ring_context). The loss share and the
// gradient reduction are Ulysses' above, over the rank's zigzag columns. No head count condition
// (grouped-query heads travel as they are); f32, bf16 and f16 (ring_attention.hpp: 16-bit blocks
// computed and merged in f32).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <vector>

#include "collective/communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/config.hpp"
#include "models/layers/sequence_exchange.hpp"
#include "models/parallel/grad_producer.hpp"
#include "models/parallel/model_producer.hpp"
#include "models/parallel/ring_context.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models::parallel {

// Buffers the exchanges of one model share (staging, the all-to-all's send and receive buffers,
// RoPE tables), grown to the largest request and kept.
struct ulysses_pool {
  owned_tensor staging, send, recv, rope_cos, rope_sin, kv_repeat, dkv_heads;
};

class ulysses_exchange final : public sequence_exchange {
 public:
  ulysses_exchange(collective::communicator& cp, std::shared_ptr<ulysses_pool> pool);

  int degree() const override { return cp_.size(); }
  void to_heads(const tensor& x, const tensor& y, std::span<const std::int64_t> sections) override;
  void to_sequence(const tensor& x, const tensor& y,
                   std::span<const std::int64_t> sections) override;
  tensor get(buffer which, const shape& s, dtype t) override;
  // Under a pipeline (context_pipeline.hpp): the layer's state kept for backward (its heads of the
  // attention output, and of the repeated kv heads) moves into stash buffer `slot` (save) or back
  // from it, by swapping buffers (no copy).
  void keep(std::size_t slot, bool save);

 private:
  collective::communicator& cp_;
  std::shared_ptr<ulysses_pool> pool_;
  owned_tensor att_heads_;                         // this layer's
  owned_tensor kv_heads_;                          // this layer's (GQA with n_kv_head < cp)
  std::vector<std::array<owned_tensor, 2>> kept_;  // keep()'s, per stash buffer
};

// This rank's columns of whole-row microbatches [rows, seq]: the ids and targets at its `pieces`
// and the weight share weight x n_r / N (see the top). The returned tensors stay valid until the
// next call.
class cp_columns {
 public:
  cp_columns(std::int64_t seq, std::vector<sequence_piece> pieces);
  microbatch_data operator()(const microbatch_data& whole, int k);
  std::int64_t local_seq() const { return local_; }
  const std::vector<sequence_piece>& pieces() const { return pieces_; }

 private:
  std::int64_t seq_ = 0, local_ = 0;
  std::vector<sequence_piece> pieces_;
  std::vector<std::int32_t> ids_, targets_;
};

// A grad_producer that runs an inner one on this rank's columns (cp_columns) of the engine's
// whole-row microbatches and is the inner one otherwise: cp_piece's (a whole model) and
// cp_pipeline_piece's (a pipeline stage's runner, context_pipeline.hpp).
class cp_columns_piece : public grad_producer {
 public:
  // The runs of global positions this rank holds of each sample, in local order.
  const std::vector<sequence_piece>& pieces() const { return columns_->pieces(); }

  layer_memory& memory() override { return inner_->memory(); }
  const slot_list& slots() const override { return inner_->slots(); }
  // fetch(k) gives whole rows [rows, seq] (the engine's); the inner piece gets this rank's columns.
  double forward_backward(int microbatches,
                          const std::function<microbatch_data(int k)>& fetch) override;
  bool set_block_grads_hook(std::function<void(std::int64_t block)> f) override {
    return inner_->set_block_grads_hook(std::move(f));
  }
  bool set_microbatch_grads_hook(std::function<void(int k, std::int64_t block)> f) override {
    return inner_->set_microbatch_grads_hook(std::move(f));
  }
  bool set_block_use_hook(block_use_hook f) override {
    return inner_->set_block_use_hook(std::move(f));
  }
  collective::communicator* norm_group() override { return inner_->norm_group(); }
  bool counts_in_norm(const tensor_slot& parameter) const override {
    return inner_->counts_in_norm(parameter);
  }

 protected:
  // The derived constructor's, once its inner piece exists (kept by reference: the derived class
  // owns it): this rank's `pieces` of `seq` positions feed `inner`.
  void feed(grad_producer& inner, std::int64_t seq, std::vector<sequence_piece> pieces);

 private:
  grad_producer* inner_ = nullptr;
  std::unique_ptr<cp_columns> columns_;
};

class cp_piece final : public cp_columns_piece {
 public:
  // The model of `model` planned for [rows, seq / cp.size()] (dtype t; recompute: per block,
  // models/trunk.hpp), this rank's part of the sequence cp.rank(). Refused naming parallel.cp: an
  // MoE model, a seq or head count that cp does not divide.
  // Ring mode: this rank's zigzag pieces; refused naming parallel.cp when 2 cp does not divide
  // seq.
  cp_piece(const hf::model_config& model, std::int64_t rows, std::int64_t seq,
           collective::communicator& cp, dtype t = dtype::f32, bool recompute = false,
           scheduler::cp_mode_kind mode = scheduler::cp_mode_kind::ulysses);
  ~cp_piece() override;
  cp_piece(const cp_piece&) = delete;
  cp_piece& operator=(const cp_piece&) = delete;

  causal_lm& model() { return *model_; }
  std::int64_t local_seq() const { return local_seq_; }
  // pieces(), and forward_backward on them (see above for the weight and the loss): the base's.

 private:
  collective::communicator& cp_;
  std::int64_t seq_ = 0, local_seq_ = 0;
  std::unique_ptr<causal_lm> model_;
  std::shared_ptr<ulysses_pool> pool_;
  std::vector<std::unique_ptr<ulysses_exchange>> exchanges_;
  std::unique_ptr<ring_context> ring_;  // ring mode
  owned_tensor positions_;              // ring mode: the global positions of the local tokens
  std::unique_ptr<model_producer> inner_;
};

}  // namespace troupe::models::parallel
