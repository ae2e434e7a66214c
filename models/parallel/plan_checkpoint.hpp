// plan_checkpoint: AdamW's moments between a parallel plan's ranks and the whole model's flat
// layout - the layout of the single-process trainer's optimizer.safetensors (models/trainer.hpp),
// so a run saved under one plan (or in one process) resumes under any other.
//
// A rank's state (dp_trainer::optimizer_view) is the moments of its piece (the whole model, a
// tensor shard, a pipeline stage, a shard of a stage), all of it (ZeRO 0) or its ZeRO shard: runs
// of the piece's flat buffer. Moving a moment between the two layouts is reshard.hpp's rule per
// parameter (copy_gpt_slice), composed with the runs:
//   gather  every rank writes the parameters it owns (replicated ones once, as gather_from_piece)
//           restricted to its runs (ZeRO 0: dp rank 0 only) into a zeroed window of the whole
//           layout; the window is summed over dp, then over mp (each element has exactly one
//           writer, so the sum is exact), and rank 0 of both groups keeps it. Windows are runs of
//           whole parameters of about window_elems elements, so a rank holds two windows and one
//           parameter of scratch, never the whole moments - except the writer, which returns them.
//   scatter local: each rank reads its parameters' slices from the whole moments (e.g. read-only
//           views of a mapped optimizer.safetensors) and keeps what falls in its runs.
#pragma once

#include <cstdint>
#include <exception>
#include <functional>
#include <string>

#include "collective/communicator.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/reshard.hpp"
#include "models/run_state.hpp"
#include "models/train_config.hpp"

namespace troupe::models::parallel {

// Collective over dp and mp (every rank of the job calls it with the same whole layout): the whole
// moments into m and v (f32, laid out like whole.base) on the rank that is rank 0 of both groups;
// elsewhere m and v are not touched (they may be empty tensors). Every rank checks its arguments
// and the ranks agree on the outcome before the windows move: when one rank's check fails (e.g.
// the writer's m and v do not fit) every rank throws (that one its own error, the others naming
// the count of failed ranks) and none waits on a collective the failed rank never joins.
void gather_moments(const piece_layout& piece, const dp_trainer::optimizer_view& mine,
                    const whole_layout& whole, collective::communicator& dp,
                    collective::communicator& mp, const tensor& m, const tensor& v,
                    std::int64_t window_elems = std::int64_t{1} << 22);

// Which moments a windowed gather carries.
enum class which_moments { both, m, v };
// Receives window [at, at + len) of the whole moments (wm, wv: f32 [len]; the one not carried is
// an undefined tensor), valid during the call.
using moment_sink = std::function<void(std::int64_t at, const tensor& wm, const tensor& wv)>;

// gather_moments' windows without the whole moments anywhere: the root (rank 0 of dp and mp)
// receives every window in order through `sink` (e.g. to write it to a file). Collective as
// gather_moments. When the sink throws, the root calls it no more but goes on with the
// collectives (so no rank is left waiting) and rethrows at the end; the other ranks return
// normally (agree_on_failure tells them).
void gather_moment_windows(const piece_layout& piece, const dp_trainer::optimizer_view& mine,
                           const whole_layout& whole, collective::communicator& dp,
                           collective::communicator& mp, const moment_sink& sink,
                           which_moments which = which_moments::both,
                           std::int64_t window_elems = std::int64_t{1} << 22);

// Collective over dp and mp: every rank learns whether any failed (`failed`: this rank's failure,
// or null). Rethrows this rank's own failure; else fails naming `what` and the count of failed
// ranks when another failed; returns when none did.
void agree_on_failure(std::exception_ptr failed, collective::communicator& dp,
                      collective::communicator& mp, const char* what);

// This rank's part of the whole moments m and v (f32, laid out like whole.base) into mine.m and
// mine.v (their runs only; the rest is left as it is). Fails naming the parameter when the whole
// model lacks one of the piece's.
void scatter_moments(const whole_layout& whole, const tensor& m, const tensor& v,
                     const piece_layout& piece, const dp_trainer::optimizer_view& mine);

// data_identity, run_extra_json, check_data_position, check_steps_left: models/run_state.hpp.

}  // namespace troupe::models::parallel
