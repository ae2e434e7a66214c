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
