// plan_checkpoint: AdamW's moments between a parallel plan's ranks and the whole model's flat
// layout - the layout of the single-process trainer's optimizer.safetensors (models/trainer.hpp),
// so a run saved under one plan (or in one process) resumes under any other.
//
// A rank's state (dp_trainer::optimizer_view) is the moments of its piece (the whole model, a
// tensor shard, a pipeline stage, a shard of a stage), all of it (ZeRO 0) or its ZeRO shard: runs
// of the piece's flat buffer. Moving a moment between the two layouts is reshard.hpp's rule per
// parameter (copy_slice), composed with the runs:
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
#include <string_view>

#include "collective/communicator.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/reshard.hpp"
#include "models/run_state.hpp"
#include "models/train_config.hpp"

namespace troupe::models::parallel {

// The window size gather_moments and gather_moment_windows use unless told (elements).
inline constexpr std::int64_t default_window_elems = std::int64_t{1} << 22;

// Collective over dp and mp (every rank of the job calls it with the same whole layout): the whole
// moments into m and v (f32, laid out like whole.base) on the rank that is rank 0 of both groups;
// elsewhere m and v are not touched (they may be empty tensors). Every rank checks its arguments
// and the ranks agree on the outcome before the windows move: when one rank's check fails (e.g.
// the writer's m and v do not fit) every rank throws (that one its own error, the others naming
// the count of failed ranks) and none waits on a collective the failed rank never joins.
void gather_moments(const piece_layout& piece, const dp_trainer::optimizer_view& mine,
                    const whole_layout& whole, collective::communicator& dp,
                    collective::communicator& mp, const tensor& m, const tensor& v,
                    std::int64_t window_elems = default_window_elems);

// Which moments a windowed gather carries.
enum class which_moments { both, m, v };
// Receives window [at, at + len) of the whole moments (wm, wv: f32 [len]; the one not carried is
// an undefined tensor), valid during the call.
using moment_sink = std::function<void(std::int64_t at, const tensor& wm, const tensor& wv)>;

// gather_moments' windows without the whole moments anywhere: the root (rank 0 of dp and mp)
// receives every window in order through `sink` (e.g. to write it to a file). Collective as
// gather_moments. Every rank allocates its buffers before the ranks agree on their checks. A rank
// whose own work on a window throws (or the root's sink) goes on with the window's collectives,
// its failure flag summed with the window (one float more), so every rank learns of it with the
// same window and all stop together; a sink failing in the last window is learnt by one agreement
// after the windows. Then every rank throws: the failed ones their own error, the others one that
// starts with `what` and names the count of failed ranks. The sink is called no more once any
// rank failed.
void gather_moment_windows(const piece_layout& piece, const dp_trainer::optimizer_view& mine,
                           const whole_layout& whole, collective::communicator& dp,
                           collective::communicator& mp, const moment_sink& sink,
                           which_moments which = which_moments::both,
                           std::int64_t window_elems = default_window_elems,
                           std::string_view what = "gather_moments");

// Collective over dp and mp: every rank learns whether any failed (`failed`: this rank's failure,
// or null). Rethrows this rank's own failure; else fails naming `what` and the count of failed
// ranks when another failed; returns when none did.
void agree_on_failure(std::exception_ptr failed, collective::communicator& dp,
                      collective::communicator& mp, std::string_view what);
// agree_on_failure's outcome once the count of failed ranks (`failures`) is known.
void throw_if_any_failed(std::exception_ptr failed, float failures, collective::communicator& dp,
                         collective::communicator& mp, std::string_view what);

// This rank's part of the whole moments m and v (f32, laid out like whole.base) into mine.m and
// mine.v (their runs only; the rest is left as it is). Fails naming the parameter when the whole
// model lacks one of the piece's.
void scatter_moments(const whole_layout& whole, const tensor& m, const tensor& v,
                     const piece_layout& piece, const dp_trainer::optimizer_view& mine);

// data_identity, run_extra_json, check_data_position, check_steps_left: models/run_state.hpp.

}  // namespace troupe::models::parallel
