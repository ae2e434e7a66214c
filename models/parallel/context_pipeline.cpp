// cp_pipeline_piece (context_pipeline.hpp): context parallelism attached to a pipeline stage.
#include "models/parallel/context_pipeline.hpp"

#include <utility>

#include "memory/error.hpp"

namespace troupe::models::parallel {

namespace {

sequence_layout layout_of(scheduler::cp_mode_kind mode) {
  return mode == scheduler::cp_mode_kind::ring ? sequence_layout::zigzag
                                               : sequence_layout::contiguous;
}

}  // namespace

cp_pipeline_piece::cp_pipeline_piece(std::unique_ptr<pipeline_runner> runner, pipeline_stage& stage,
                                     std::int64_t seq, collective::communicator& cp,
                                     scheduler::cp_mode_kind mode)
    : runner_(std::move(runner)), pool_(std::make_shared<ulysses_pool>()) {
  const int n = cp.size();
  const bool ring = mode == scheduler::cp_mode_kind::ring;
  TROUPE_CHECK(n >= 1 && seq % (ring ? 2 * n : n) == 0, "context parallelism (",
               scheduler::name(mode), ") in pipeline stages: ", ring ? "2 x " : "",
               "parallel.cp = ", ring ? 2 * n : n, " does not divide train.seq = ", seq);
  TROUPE_CHECK(stage.dims().seq == seq / n, "context parallelism in pipeline stages: stage ",
               stage.stage(), " is planned for ", stage.dims().seq,
               " positions, not train.seq / parallel.cp = ", seq / n);
  const std::int64_t tl = seq / n;
  positions_ = empty({tl}, dtype::i32);
  const auto pos = local_positions(seq, n, cp.rank(), layout_of(mode));
  for (std::int64_t i = 0; i < tl; ++i)
    positions_.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(pos[i]);
  stage_context c;
  c.positions = positions_;
  if (ring) {
    ring_ = std::make_unique<ring_context>(cp, sequence_layout::zigzag);
    c.ring = ring_.get();
  } else {
    std::int64_t blocks = 0;
    for (int k = 0; k < stage.chunks(); ++k) blocks = std::max(blocks, stage.end_block(k));
    for (std::int64_t i = 0; i < blocks; ++i)
      exchanges_.push_back(std::make_unique<ulysses_exchange>(cp, pool_));
    c.exchange = [this](std::int64_t i) {
      return exchanges_.at(static_cast<std::size_t>(i)).get();
    };
    c.keep = [this](std::int64_t i, std::size_t slot, bool save) {
      exchanges_.at(static_cast<std::size_t>(i))->keep(slot, save);
    };
  }
  stage.set_context(c);
  feed(*runner_, seq, sequence_pieces(seq, n, cp.rank(), layout_of(mode)));
}

cp_pipeline_piece::~cp_pipeline_piece() = default;

}  // namespace troupe::models::parallel
