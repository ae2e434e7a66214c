// sft_step: SFT micro-batches (sft_step.hpp).
#include "models/post/sft_step.hpp"

#include <vector>

#include "memory/error.hpp"

namespace troupe::models {

trainer::micro_batch sft_micro_batch(std::shared_ptr<const sft_rows> rows, std::int64_t batch) {
  struct buffers {
    std::vector<std::int32_t> ids, targets, segments, positions;
  };
  auto buf = std::make_shared<buffers>();
  return [rows, batch, buf](causal_lm& model, std::uint64_t draw, double loss_scale) {
    auto& b = *buf;
    sft_batch(*rows, static_cast<std::int64_t>(draw), batch, b.ids, b.targets, b.segments,
              b.positions);
    const shape bt{batch, rows->seq};
    auto view = [&](std::vector<std::int32_t>& v) {
      return tensor(v.data(), v.size() * sizeof(std::int32_t), dtype::i32, bt);
    };
    TROUPE_CHECK(model.set_packing(view(b.segments), view(b.positions)),
                 "sft: the model cannot run packed rows");
    const double loss = model.forward(view(b.ids), view(b.targets));
    model.backward(loss_scale);
    model.set_packing(tensor{}, tensor{});
    return loss;
  };
}

}  // namespace troupe::models
