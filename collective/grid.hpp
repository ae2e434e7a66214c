// The named rank grid: a job's ranks arranged as an N-D mesh with named axes (dp, pp, tp, sp, ep).
//
// Built explicitly from degrees in a chosen order (the first axis varies slowest) and passed
// explicitly: there is no global grid. A group is the set of ranks that differ only along the
// chosen axes; every rank belongs to exactly one group per axis set, and groups get ids that are
// equal on every rank, so a communicator for "tp" or for {"dp", "sp"} is made from grid.group(rank,
// axes).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace troupe::collective {

struct grid_axis {
  std::string name;  // "dp", "pp", "tp", "sp", "ep" (other names are allowed)
  int degree = 1;
};

// The ranks of one group, in group-rank order, and an id equal on all its members and distinct
// between the groups (and axis sets) of one grid.
struct rank_group {
  std::uint32_t id = 0;
  std::vector<int> ranks;              // world ranks; ranks[i] has group rank i
  int index_of(int world_rank) const;  // -1 if not a member
};

class rank_grid {
 public:
  // Degrees multiply to the world size; names are unique; degrees >= 1. Errors name the field.
  explicit rank_grid(std::vector<grid_axis> axes);

  int world_size() const { return world_; }
  const std::vector<grid_axis>& axes() const { return axes_; }
  int degree(const std::string& axis) const;  // 1 for an axis the grid does not have
  std::vector<int> coords(int rank) const;    // one coordinate per axis, in axis order
  int coord(int rank, const std::string& axis) const;
  int rank_of(const std::vector<int>& coords) const;
  // The group containing `rank` whose members differ only along `axes`.
  rank_group group(int rank, const std::vector<std::string>& axes) const;
  // Every group for an axis set (they partition the world).
  std::vector<rank_group> groups(const std::vector<std::string>& axes) const;
  std::string describe() const;  // e.g. "dp2 x pp2 x tp2"

 private:
  std::vector<grid_axis> axes_;
  int world_ = 1;
};

}  // namespace troupe::collective
