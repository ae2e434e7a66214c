// mixed_piece (see mixed_piece.hpp).
#include "models/parallel/mixed_piece.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

mixed_piece::mixed_piece(grad_producer& inner) : inner_(inner) {
  const dtype t = inner.memory().params().type();
  TROUPE_CHECK(t == dtype::bf16, "mixed_piece: the inner piece must compute in bf16, its ",
               "parameters are ", dtype_name(t));
  for (const auto& s : inner.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    tensor& value = fields_.emplace_back();
    tensor& grad = fields_.emplace_back();
    if (s.block >= 0) {
      const auto mark = slots_.mark_block(s.block);
      slots_.param(s.name, s.sizes, value, grad, s.spec);
    } else {
      slots_.param(s.name, s.sizes, value, grad, s.spec);
    }
  }
  master_ = layer_memory(slots_, dtype::f32, inner.memory().params().dev());
  // The master weights start as the inner piece's (whatever set them); the caller may overwrite
  // them (init_piece, load_piece write the f32 values into memory().params()).
  for (std::size_t i = 0, j = 0; i < inner.slots().slots().size(); ++i) {
    const auto& s = inner.slots().slots()[i];
    if (s.kind != slot_kind::param) continue;
    ops::copy(*s.field, fields_[2 * j]);
    ++j;
  }
}

void mixed_piece::round_master() {
  std::size_t j = 0;
  for (const auto& s : inner_.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    ops::copy(fields_[2 * j], *s.field);
    ops::copy(*s.field, fields_[2 * j]);
    ++j;
  }
}

double mixed_piece::forward_backward(int microbatches,
                                     const std::function<microbatch_data(int k)>& fetch) {
  // Round the master weights into the piece: each parameter by itself, as the layouts of the two
  // flat buffers differ in their padding.
  std::size_t j = 0;
  for (const auto& s : inner_.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    ops::copy(fields_[2 * j], *s.field);
    ++j;
  }
  inner_.memory().zero_grads();
  const double loss = inner_.forward_backward(microbatches, fetch);
  j = 0;
  for (const auto& s : inner_.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    // The engine zeroed (or gave back, reading as zeros) the f32 gradients before the step.
    ops::copy(*s.grad, fields_[2 * j + 1]);
    ++j;
  }
  return loss;
}

}  // namespace troupe::models::parallel
