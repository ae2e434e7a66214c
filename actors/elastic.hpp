// Elastic training's bookkeeping (actors/training.hpp runs it): which process holds which grid
// position of the plan, which processes are idle spares, and - when ranks are lost - which spare
// takes which position and which survivor hands it the lost piece's state.
//
// A launched elastic run has plan.world_size() positions (the dp x pp x tp grid of
// collective::rank_grid) and plan.world_size() + spares processes. Generation 0 puts rank i at
// position i and keeps the last `spares` ranks idle. Each recovery is a new generation: a lost
// position gets the lowest alive spare, and its state comes from a survivor holding the same piece
// (same pp and tp coordinates, another dp replica) when ZeRO is 0, so every dp replica holds the
// whole piece state. Communicators of generation g have group ids with g in bits 24-31
// (group_id_of), so no message of an earlier generation matches one of a later.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "collective/grid.hpp"
#include "memory/error.hpp"

namespace troupe::actors {

struct elastic_layout {
  std::vector<int> positions;  // grid position -> rank holding it
  std::vector<int> spares;     // idle ranks, ascending
  int generation = 0;
  // Generation 0: ranks 0..positions-1 hold the positions, the rest are spares.
  static elastic_layout initial(int positions, int world);
  int position_of(int rank) const;  // -1: a spare (or not in the job any more)
};

// Whether rank `rank`, whose layout is `mine`, may take the layout of generation `generation`
// (a recovery's or a shrink's): the next one, or any later one while it holds no position. The
// driver asks only the ranks of the new positions to recover, so an idle spare is not told of
// the recoveries that pass it by and still holds an older generation when it is called.
bool takes_generation(const elastic_layout& mine, int rank, int generation);

// One lost position and how it is filled.
struct replacement {
  int position = -1;   // grid position
  int lost = -1;       // the rank that held it
  int spare = -1;      // the rank that takes it
  int donor = -1;      // the survivor that sends it the piece's state
  bool buddy = false;  // from the donor's buddy replica (its copy of the last replicated step)
};

// Buddy replicas (elastic.replica_interval): position p keeps a copy of position p - 1's piece
// state (the ring in position order), so position p + 1 holds p's.
int buddy_holder(int position, int positions);

// The replacements for the ranks `lost` (positions and spares among them; others are ignored),
// and the layout of the next generation. The donor is a data-parallel replica (ZeRO 0), else -
// with `buddies` - the position holding the lost one's buddy replica. Fails, naming the lost rank,
// its coordinates and the reason, when no spare is left or no survivor holds its piece.
struct recovery_plan {
  elastic_layout next;
  std::vector<replacement> moves;
};
expected<recovery_plan> plan_recovery(const collective::rank_grid& grid, const elastic_layout& now,
                                      const std::vector<int>& lost, int zero, bool buddies = false);

// Shrinking (elastic.min_ranks below the plan's ranks): with no spare left, the job goes on with
// fewer data-parallel replicas on the survivors. The model pieces (pp x tp) stay as they are, dp
// goes down to the most replicas every piece still has a survivor for (ZeRO 0: each survivor holds
// its piece's whole state, so no state moves), and parallel.microbatches goes up so that
// dp x microbatches - the slots the global batch train.batch x train.grad_accum is split into -
// stays the same: each step reads the same samples, each micro-batch keeps its rows. Survivors
// not needed by the new grid (and any spares) become its spares.
struct shrink_plan {
  elastic_layout next;           // the new grid's positions, in its order, and the idle ranks
  int dp = 0, microbatches = 0;  // the new plan's (pp and tp unchanged)
};
// ZeRO 1-3 (zero > 0): no survivor holds a lost rank's shard but its buddy (buddy_holder), so
// shrinking needs buddy replicas (`buddies`), a plan of one piece (pp = tp = 1) and every lost
// position's buddy holder alive; every survivor then takes part in resharding the whole state onto
// the new dp (actors/training.cpp).
// `grid` is the current plan's (axes dp, cp, pp, tp in its order; a piece is a position's
// coordinates on every axis but dp), `dp` and `microbatches` its degrees; the new micro-batches
// per replica are a multiple of `microbatch_multiple` (parallel.pp for the interleaved schedule,
// which scheduler::validate requires). Fails naming the lost ranks, what the survivors allow and
// elastic.min_ranks (--min-ranks) when the largest plan has fewer than `min_ranks` ranks, or
// naming the setting that a ZeRO shrink lacks.
expected<shrink_plan> plan_shrink(const collective::rank_grid& grid, int dp, int microbatches,
                                  const elastic_layout& now, const std::vector<int>& lost,
                                  int min_ranks, int zero, bool buddies = false,
                                  int microbatch_multiple = 1);
// Growing back (docs/adr/0005, section 11): a shrunk run with idle ranks (survivors a shrink left
// idle, joiners) takes the largest dp up to `target_dp` (the plan it started with) that divides
// the dp x microbatches slots of the global batch into micro-batches the schedule runs (a multiple
// of `microbatch_multiple`) and that the positions and spares fill; parallel.microbatches goes
// down by the same factor, so each step reads the same samples. Every position holder keeps its
// piece and dp coordinate; each new replica's position is given to the lowest spare, its state
// from the holder of dp 0 of its piece (ZeRO 0: whole piece state on every replica). Fails,
// saying why, when no larger plan fits (the run goes on as it is).
struct grow_plan {
  elastic_layout next;
  int dp = 0, microbatches = 0;
  std::vector<replacement> moves;  // the new positions: spare, donor (lost: -1)
};
expected<grow_plan> plan_grow(const collective::rank_grid& grid, int dp, int microbatches,
                              const elastic_layout& now, int target_dp,
                              int microbatch_multiple = 1);
// The group of the ranks `ranks` (ascending) that reshard a ZeRO state at a shrink.
collective::rank_group reshard_group(const std::vector<int>& ranks, int generation);
// "dp2 x pp2": the grid's dp and its axes of degree > 1.
std::string plan_text(const collective::rank_grid& grid);
// The grid of the same axes as `grid` with dp of degree `dp`.
collective::rank_grid with_dp(const collective::rank_grid& grid, int dp);

// The disk fallback's layout: each lost position (lost ranks among `now`'s positions) gets the
// lowest alive spare, with no donor (the piece comes from a checkpoint). Fails, naming the lost
// rank and its coordinates, when no spare is left for one.
expected<recovery_plan> plan_replacement(const collective::rank_grid& grid,
                                         const elastic_layout& now, const std::vector<int>& lost);

// The group id of a communicator of generation `generation` (0-255) for a grid group `base`.
std::uint32_t group_id_of(std::uint32_t base, int generation);
// The 2-rank group {donor, spare} that moves a piece's state to the spare at `position`.
collective::rank_group restore_group(int position, int donor, int spare, int generation);
// The 2-rank group {sender, receiver} that carries position `from`'s buddy replica.
collective::rank_group buddy_group(int from, int sender, int receiver, int generation);
// The grid group of position `position` over axes `axes` in `layout` (ranks mapped, id of its
// generation).
collective::rank_group elastic_group(const collective::rank_grid& grid,
                                     const elastic_layout& layout, int position,
                                     const std::vector<std::string>& axes);

// "dp 1 pp 0 tp 0": a position's coordinates.
std::string coordinates(const collective::rank_grid& grid, int position);

}  // namespace troupe::actors
