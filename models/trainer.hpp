// trainer: the single-process training loop every parallel plan is later compared against.
//
// One step: grad_accum micro-batches (forward, backward into accumulated gradients, scaled by
// 1 / grad_accum so the step's gradient is that of the mean loss), global-norm clipping, the
// warmup + cosine learning rate, one AdamW update. Micro-batch k of step s reads draw
// s * grad_accum + k of the data (draw 0 always with fixed_batch), so the batches are a pure
// function of (seed, step) and a resumed run sees what it would have seen. Rows hold T tokens; the
// targets are the next tokens with the last position ignored: HF's labels=input_ids loss over
// B x (T-1) positions.
//
// Mixed precision (precision "bf16" or "f16"; the model is built in that dtype): the trainer keeps
// f32 master weights and f32 gradients. After backward the 16-bit gradients are converted to f32
// and unscaled, clipped and applied to the master weights by AdamW; the master weights are then
// rounded into the model. With f16 the loss is scaled (torch GradScaler's defaults: 2^16 at the
// start, halved when gradients overflow, when the step is skipped, doubled after 2000 good
// steps). Checkpoints hold the f32 master weights.
//
// precision "f64" (the model built in f64, CPU) runs the same loop with every buffer and the
// optimizer state in f64 and no master copy. It is the reference the f32 runs are judged against:
// its rounding is ~1e-16 relative, so its distance to an f32 run is that run's own f32 error
// (tests/rounding.hpp).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/hf/training_state.hpp"
#include "models/loss_scaler.hpp"
#include "models/optim.hpp"
#include "models/run_state.hpp"
#include "models/train_config.hpp"

namespace troupe::models {

struct step_result {
  std::int64_t step = 0;  // 1-based: steps completed after this one
  double loss = 0;        // mean over the micro-batches
  double grad_norm = 0;   // before clipping
  double lr = 0;
  std::int64_t tokens = 0;  // tokens consumed (B x T x grad_accum)
  double seconds = 0;
  bool skipped = false;     // f16: gradients overflowed, no update was made
  double loss_scale = 1.0;  // the scale used for this step
};

class trainer {
 public:
  // Fills rows (batch x seq i32 token ids) for draw `draw`.
  using batch_source =
      std::function<void(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows)>;

  // Build the trainer after the model's weights are set (initialized or loaded): with mixed
  // precision it takes its f32 master weights from the model here. resume() loads both.
  trainer(causal_lm& model, const train_config& cfg);

  step_result step(const batch_source& data);
  // One micro-batch of a mode that makes its own batches and loss (SFT's packed rows, DPO's
  // pairs: models/post/): runs forward and backward of loss_scale * its loss for draw `draw` on
  // the model and returns the loss. The step around it is the same: accumulation, clipping, the
  // schedule, AdamW, mixed precision.
  using micro_batch =
      std::function<double(causal_lm& model, std::uint64_t draw, double loss_scale)>;
  step_result step(const micro_batch& run);
  std::int64_t steps_done() const { return step_; }
  const adamw_optimizer& optimizer() const { return opt_; }
  // The weights AdamW updates: the f32 master weights with mixed precision, else the model's.
  const tensor& master_weights() const { return weights(); }

  // Weights (HF layout), config.json, optimizer.safetensors and trainer_state.json.
  expected<std::filesystem::path> save(const std::filesystem::path& folder,
                                       const hf::model_config& cfg) const;
  // Loads all of the above back (the model must be built from the same config); refuses a
  // checkpoint whose run read its data differently (resumable_state).
  expected<std::int64_t> resume(const std::filesystem::path& folder, const hf::model_config& cfg);

 private:
  bool mixed() const { return master_.defined(); }
  const tensor& weights() const { return mixed() ? master_.view() : model_.memory().params(); }
  const tensor& grads() const { return mixed() ? grads32_.view() : model_.memory().grads(); }

  causal_lm& model_;
  train_config cfg_;
  owned_tensor master_, grads32_;  // mixed precision: f32 copies of the flat buffers
  std::vector<tensor> master_views_;
  slot_list master_slots_;  // the model's parameter names over the master weights
  adamw_optimizer opt_;
  std::int64_t step_ = 0;
  loss_scaler scaler_;  // f16's dynamic loss scaling (other precisions: scale 1, never used)
  std::vector<std::int32_t> rows_, targets_;
};

// run_state_extra, resumable_state (the checkpoint's run identity, the resume checks):
// models/run_state.hpp.

// The mean loss of `batches` draws of the data (from draw `first`), without gradients.
double evaluate(causal_lm& model, const trainer::batch_source& data, int batch, int seq,
                std::uint64_t first, int batches);

}  // namespace troupe::models
