// mixed_piece (see mixed_piece.hpp).
#include "models/parallel/mixed_piece.hpp"

#include <optional>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

mixed_piece::mixed_piece(grad_producer& inner)
    : inner_(inner), scales_loss_(inner.memory().params().type() == dtype::f16) {
  const dtype t = inner.memory().params().type();
  TROUPE_CHECK(t == dtype::bf16 || t == dtype::f16,
               "mixed_piece: the inner piece must compute in bf16 or f16, its parameters are ",
               dtype_name(t));
  for (const auto& s : inner.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    tensor& value = fields_.emplace_back();
    tensor& grad = fields_.emplace_back();
    std::optional<slot_list::block_mark> mark;
    if (s.block >= 0) mark.emplace(slots_.mark_block(s.block));
    slots_.param(s.name, s.sizes, value, grad, s.spec);
    params_.push_back({&s, nullptr});
  }
  master_ = layer_memory(slots_, dtype::f32, inner.memory().params().dev());
  for (std::size_t k = 0; k < params_.size(); ++k) params_[k].master = &slots_.slots()[k];
  // The master weights start as the inner piece's (whatever set them); the caller may overwrite
  // them (init_piece, load_piece write the f32 values into memory().params()).
  for (const auto& p : params_) ops::copy(*p.inner->field, *p.master->field);
}

// Each parameter by itself: the two flat buffers' layouts differ in their padding.
void mixed_piece::round_into_inner() {
  for (const auto& p : params_) ops::copy(*p.master->field, *p.inner->field);
}

void mixed_piece::round_master() {
  round_into_inner();
  for (const auto& p : params_) ops::copy(*p.inner->field, *p.master->field);
}

double mixed_piece::forward_backward(int microbatches,
                                     const std::function<microbatch_data(int k)>& fetch) {
  round_into_inner();
  inner_.memory().zero_grads();
  const double s = loss_scale_;
  double loss = 0;
  if (s == 1.0) {
    loss = inner_.forward_backward(microbatches, fetch);
  } else {  // the backward of s x each microbatch's weighted loss
    loss = inner_.forward_backward(microbatches, [&](int k) {
      microbatch_data mb = fetch(k);
      mb.weight *= s;
      return mb;
    }) / s;
  }
  // The engine zeroed (or gave back, reading as zeros) the f32 gradients before the step. Each
  // parameter by itself (never the whole buffer: released pages stay released).
  finite_ = true;
  for (const auto& p : params_) {
    ops::copy(*p.inner->grad, *p.master->grad);
    if (s != 1.0) ops::scale(*p.master->grad, 1.0 / s);
    if (scales_loss_ && finite_) finite_ = ops::all_finite(*p.master->grad);
  }
  return loss;
}

}  // namespace troupe::models::parallel
