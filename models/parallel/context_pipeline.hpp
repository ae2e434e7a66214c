// Context parallelism inside pipeline stages (parallel.cp > 1 with parallel.pp > 1): each stage's
// blocks run on the rank's part of every sample's sequence, its cp group the ranks that hold the
// same stage for the other parts (the grid's "cp" axis: the same pp coordinate), so the
// activations passed between stages are the part's, [rows, T/cp, C].
//
//   Ulysses  each held block's attention exchanges heads <-> sequence with the stage's cp group
//            (ulysses_exchange, one per block); the heads an exchange keeps for backward move
//            with the stage's stash (stage_context::keep), so microbatches in flight under 1F1B or
//            the interleaved schedule keep theirs.
//   ring     each held block's attention runs its core over the ring (ring_context, one per
//            stage), the stage's tokens the zigzag pieces; everything the ring's backward reads is
//            in the attention's own slots, which the stash keeps.
//
// GPT-2's learned positions read the part's global positions (stage_context::positions); RoPE
// rotates inside the attention (Ulysses after the exchange, ring at the pieces' positions).
//
// cp_pipeline_piece is the grad_producer: the pipeline runner over such a stage, fed this rank's
// columns of each microbatch (cp_columns: ids and targets of its part, weight x n_r / N), so the
// last stage's loss is the rank's share as cp_piece's is; the engine reduces over dp x cp (every
// rank with the same stage), exactly as for cp_piece, and the pipeline's loss and norm groups are
// pp's as without cp. Not with tp > 1 (refused by scheduler::validate, naming parallel.tp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "collective/communicator.hpp"
#include "models/parallel/context_parallel.hpp"
#include "models/parallel/grad_producer.hpp"
#include "models/parallel/pipeline_runner.hpp"
#include "models/parallel/pipeline_stage.hpp"
#include "models/parallel/ring_context.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models::parallel {

class cp_pipeline_piece final : public cp_columns_piece {
 public:
  // `stage` (unsharded, planned for [rows, seq / cp.size()]) run by `runner`; attaches the
  // context of `mode` over `cp` to the stage. Refused naming parallel.cp when cp does not divide
  // seq (ring: 2 cp), or the stage's planned length is not seq / cp.
  cp_pipeline_piece(std::unique_ptr<pipeline_runner> runner, pipeline_stage& stage,
                    std::int64_t seq, collective::communicator& cp, scheduler::cp_mode_kind mode);
  ~cp_pipeline_piece() override;
  cp_pipeline_piece(const cp_pipeline_piece&) = delete;
  cp_pipeline_piece& operator=(const cp_pipeline_piece&) = delete;

  pipeline_runner& runner() { return *runner_; }
  // pieces(), forward_backward on this rank's columns and the rest from the runner: the base's.

 private:
  std::unique_ptr<pipeline_runner> runner_;
  std::shared_ptr<ulysses_pool> pool_;
  std::vector<std::unique_ptr<ulysses_exchange>> exchanges_;  // Ulysses: by global block
  std::unique_ptr<ring_context> ring_;                        // ring
  owned_tensor positions_;  // the global positions of the local tokens
};

}  // namespace troupe::models::parallel
