// mixed_piece: a model piece that computes in bf16 or f16 (the whole model, a tensor shard, a
// pipeline stage's runner or a shard of a stage: hybrid.cpp builds it under every plan), presented
// to the data-parallel engine (data_parallel.hpp) as an f32 piece: the engine reduces f32
// gradients, clips, shards and steps f32 master weights with AdamW, exactly as it does for an f32
// piece, and the piece's bf16 parameters are the master weights rounded - the single-process
// trainer's mixed precision (models/trainer.hpp), with the data-parallel reduction between the
// 16-bit gradients and the update.
//
// A step: the master weights (gathered by the engine first under ZeRO 3) are rounded into the
// inner piece's parameters, the inner piece runs its microbatches (bf16 forward and backward,
// gradients accumulated in bf16 with each microbatch's weight), and its gradients are converted
// into the f32 gradient buffer the engine reduces. The inner piece's parameters stay whole on
// every rank (ZeRO shards the f32 master weights, gradients and moments, not the bf16 copy), and
// its gradients reach the engine once, after the last microbatch: no block hooks, so the
// reduction does not overlap backward. Checkpoints hold the f32 master weights, as the
// single-process trainer's do.
//
// f16 adds loss scaling (models/loss_scaler.hpp): the engine owns the scaler and sets the factor
// before each step (set_loss_scale: the scale times train.grad_accum); the piece multiplies each
// microbatch's weight (rows / the step's rows) by it, divides the f32 gradients by it, and reports
// whether its own gradients are all finite (grads_finite); the engine agrees on the step's skip
// over the whole grid. With that factor every token's loss gets the seed it gets in the
// single-process trainer (scale / (train.batch x seq): its microbatches of train.batch rows each
// run the backward of scale x their mean loss), so every per-token gradient (the logits', the
// activations') is as large as there, and every f16 gradient a rank accumulates is a part (its
// rows, its shard, its blocks) of the single process's f16 sum: the plan overflows where the
// single process does, not earlier because its microbatches are smaller.
#pragma once

#include <deque>
#include <functional>
#include <vector>

#include "models/parallel/grad_producer.hpp"

namespace troupe::models::parallel {

class mixed_piece final : public grad_producer {
 public:
  // inner: the bf16 or f16 piece (its memory in that type); must outlive this.
  explicit mixed_piece(grad_producer& inner);
  mixed_piece(const mixed_piece&) = delete;
  mixed_piece& operator=(const mixed_piece&) = delete;

  // The f32 master weights and gradients, laid out by the inner piece's parameter slots (names,
  // layouts and blocks as declared there).
  layer_memory& memory() override { return master_; }
  const slot_list& slots() const override { return slots_; }
  // Rounds the master weights to the values the piece computes with (through bf16 / f16), as the
  // single-process trainer's master weights start: after writing fresh weights into memory()
  // (an init, HF weights), not after a resume (a checkpoint holds the master weights).
  void round_master();
  double forward_backward(int microbatches,
                          const std::function<microbatch_data(int k)>& fetch) override;
  void set_every_stage_reads(bool on) override { inner_.set_every_stage_reads(on); }
  bool scales_loss() const override { return scales_loss_; }
  void set_loss_scale(double s) override { loss_scale_ = s; }
  bool grads_finite() override { return finite_; }
  collective::communicator* norm_group() override { return inner_.norm_group(); }
  bool counts_in_norm(const tensor_slot& parameter) const override {
    return inner_.counts_in_norm(parameter);
  }

 private:
  void round_into_inner();  // the master weights, rounded, into the inner piece's parameters

  grad_producer& inner_;
  bool scales_loss_ = false;  // f16
  double loss_scale_ = 1.0;
  bool finite_ = true;
  std::deque<tensor> fields_;  // the master slots' value and gradient fields (stable addresses)
  struct param_pair {
    const tensor_slot* inner;   // the inner piece's parameter slot
    const tensor_slot* master;  // its f32 master slot (slots_, same order)
  };
  std::vector<param_pair> params_;
  slot_list slots_;
  layer_memory master_;
};

}  // namespace troupe::models::parallel
