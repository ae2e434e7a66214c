// sft_step: SFT micro-batches (sft_step.hpp).
#include "models/post/sft_step.hpp"

#include <vector>

#include "memory/error.hpp"

namespace troupe::models {

namespace {

// Assistant targets in the rows of draw d.
std::int64_t targets_of(const sft_rows& rows, std::int64_t draw, std::int64_t batch) {
  std::int64_t n = 0;
  for (std::int64_t i = 0; i < batch; ++i) {
    const std::int64_t r = (draw * batch + i) % rows.rows();
    for (std::int64_t t = 0; t < rows.seq; ++t)
      n += rows.targets[static_cast<std::size_t>(r * rows.seq + t)] != -100;
  }
  return n;
}

}  // namespace

trainer::micro_batch sft_micro_batch(std::shared_ptr<const sft_rows> rows, std::int64_t batch,
                                     std::int64_t grad_accum) {
  TROUPE_CHECK(grad_accum > 0, "sft: grad_accum must be > 0, got ", grad_accum);
  struct buffers {
    std::vector<std::int32_t> ids, targets, segments, positions;
  };
  auto buf = std::make_shared<buffers>();
  return [rows, batch, grad_accum, buf](causal_lm& model, std::uint64_t draw, double loss_scale) {
    auto& b = *buf;
    // This micro-batch's share of the step's assistant tokens.
    const auto d = static_cast<std::int64_t>(draw);
    std::int64_t total = 0;
    for (std::int64_t k = d - d % grad_accum; k < d - d % grad_accum + grad_accum; ++k)
      total += targets_of(*rows, k, batch);
    const std::int64_t mine = targets_of(*rows, d, batch);
    const double share =
        total == 0 ? 1.0 : static_cast<double>(grad_accum * mine) / static_cast<double>(total);
    sft_batch(*rows, static_cast<std::int64_t>(draw), batch, b.ids, b.targets, b.segments,
              b.positions);
    const shape bt{batch, rows->seq};
    auto view = [&](std::vector<std::int32_t>& v) {
      return tensor(v.data(), v.size() * sizeof(std::int32_t), dtype::i32, bt);
    };
    TROUPE_CHECK(model.set_packing(view(b.segments), view(b.positions)),
                 "sft: the model cannot run packed rows");
    const double loss = model.forward(view(b.ids), view(b.targets));
    model.backward(loss_scale * share);
    model.set_packing(tensor{}, tensor{});
    return loss * share;
  };
}

}  // namespace troupe::models
