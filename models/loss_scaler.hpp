// loss_scaler: f16's dynamic loss scaling, one for the single-process trainer (models/trainer.hpp)
// and the data-parallel engine under every plan (models/parallel/data_parallel.hpp).
//
// The backward runs on scale() x the loss, so f16's small gradients stay above its subnormals; the
// gradients are divided by the scale in f32. A step whose gradients hold an inf or a NaN anywhere
// (under a plan: on any rank of the grid, decided by the engine) makes no update and halves the
// scale; after growth_interval good steps in a row the scale doubles. The scale stays a power of
// two when it starts as one, so scaling and unscaling are exact.
#pragma once

#include <cstdint>
#include <string>

namespace troupe::models {

class loss_scaler {
 public:
  // train.loss_scale (--loss-scale) and train.loss_scale_growth (--loss-scale-growth).
  loss_scaler(double initial, std::int64_t growth_interval);

  double scale() const { return scale_; }
  std::int64_t good_steps() const { return good_; }

  // After a step whose gradients were (not) all finite: true when the step is skipped.
  bool update(bool overflow);

  // The checkpoint's keys ("loss_scale", "good_steps"), a JSON object.
  std::string json() const;
  // Takes the scale and count from a checkpoint's trainer_state.json "extra" when the run that
  // wrote it trained in f16 (its "precision"); an f32 / bf16 run records a scale of 1, which would
  // start this run at 1 instead of its initial scale. True when taken.
  bool resume_from(const std::string& extra_json);

 private:
  double scale_;
  std::int64_t growth_;
  std::int64_t good_ = 0;  // good steps since the scale last changed
};

}  // namespace troupe::models
