// Elastic training's bookkeeping (see elastic.hpp).
#include "actors/elastic.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <map>
#include <utility>

namespace troupe::actors {

elastic_layout elastic_layout::initial(int positions, int world) {
  TROUPE_CHECK(positions > 0 && world >= positions, "elastic: ", positions,
               " grid positions do not fit a job of ", world, " ranks");
  elastic_layout l;
  for (int r = 0; r < positions; ++r) l.positions.push_back(r);
  for (int r = positions; r < world; ++r) l.spares.push_back(r);
  return l;
}

int elastic_layout::position_of(int rank) const {
  auto it = std::find(positions.begin(), positions.end(), rank);
  return it == positions.end() ? -1 : static_cast<int>(it - positions.begin());
}

std::string coordinates(const collective::rank_grid& grid, int position) {
  return fmt::format("dp {} pp {} tp {}", grid.coord(position, "dp"), grid.coord(position, "pp"),
                     grid.coord(position, "tp"));
}

int buddy_holder(int position, int positions) {
  return (position + 1) % positions;
}

bool takes_generation(const elastic_layout& mine, int rank, int generation) {
  return generation == mine.generation + 1 ||
         (generation > mine.generation && mine.position_of(rank) < 0);
}

namespace {

// A plan of the next generation: the layout as it is, less the lost spares; the lost positions
// are for the caller to fill.
expected<recovery_plan> next_generation(const elastic_layout& now, const std::vector<int>& lost) {
  recovery_plan p;
  p.next = now;
  p.next.generation = now.generation + 1;
  if (p.next.generation > 255)
    return expected<recovery_plan>::failure(
        "elastic: 255 recoveries in one run, the most group ids can tell apart");
  // A rank that is both a position holder and a spare is a joiner that took the number of the
  // lost holder (troupe launch --join): the new process stays a spare.
  std::erase_if(p.next.spares, [&](int r) {
    return std::find(lost.begin(), lost.end(), r) != lost.end() && now.position_of(r) < 0;
  });
  return p;
}

}  // namespace

expected<recovery_plan> plan_recovery(const collective::rank_grid& grid, const elastic_layout& now,
                                      const std::vector<int>& lost, int zero, bool buddies) {
  using result = expected<recovery_plan>;
  auto is_lost = [&](int r) { return std::find(lost.begin(), lost.end(), r) != lost.end(); };
  auto started = next_generation(now, lost);
  if (!started) return started;
  recovery_plan p = std::move(*started);
  for (int pos = 0; pos < static_cast<int>(now.positions.size()); ++pos) {
    const int r = now.positions[pos];
    if (!is_lost(r)) continue;
    const std::string who = fmt::format("rank {} ({})", r, coordinates(grid, pos));
    if (p.next.spares.empty())
      return result::failure(fmt::format("elastic: {} was lost and no spare rank is left", who));
    // A survivor with the same piece: the other dp replicas of this position.
    int donor = -1;
    if (zero == 0) {
      for (int q = 0; q < static_cast<int>(now.positions.size()) && donor < 0; ++q)
        if (q != pos && grid.coord(q, "pp") == grid.coord(pos, "pp") &&
            grid.coord(q, "tp") == grid.coord(pos, "tp") && !is_lost(now.positions[q]))
          donor = now.positions[q];
    }
    bool from_buddy = false;
    const int npos = static_cast<int>(now.positions.size());
    if (donor < 0 && buddies && npos > 1) {
      const int holder = now.positions[static_cast<std::size_t>(buddy_holder(pos, npos))];
      if (!is_lost(holder)) {
        donor = holder;
        from_buddy = true;
      }
    }
    if (donor < 0 && buddies)
      return result::failure(fmt::format(
          "elastic: {} was lost and no survivor holds its piece: no data-parallel replica{}, and "
          "rank {}, which holds its buddy replica, was lost too",
          who, zero != 0 ? fmt::format(" (parallel.zero {} shards its state)", zero) : "",
          now.positions[static_cast<std::size_t>(buddy_holder(pos, npos))]));
    if (donor < 0)
      return result::failure(fmt::format(
          "elastic: {} was lost and no survivor holds its piece ({}): restoring it needs a "
          "data-parallel replica with ZeRO 0, or buddy replicas (elastic.replica_interval)",
          who,
          zero != 0 ? fmt::format("parallel.zero {} shards its state", zero)
                    : std::string("every data-parallel replica of it is lost, or dp is 1")));
    replacement m;
    m.position = pos;
    m.lost = r;
    m.spare = p.next.spares.front();
    m.donor = donor;
    m.buddy = from_buddy;
    p.next.spares.erase(p.next.spares.begin());
    p.next.positions[pos] = m.spare;
    p.moves.push_back(m);
  }
  return p;
}

std::string plan_text(const collective::rank_grid& grid) {
  std::string out;
  for (const auto& a : grid.axes())
    if (a.name == "dp" || a.degree > 1)
      out += fmt::format("{}{}{}", out.empty() ? "" : " x ", a.name, a.degree);
  return out;
}

collective::rank_grid with_dp(const collective::rank_grid& grid, int dp) {
  auto axes = grid.axes();
  for (auto& a : axes)
    if (a.name == "dp") a.degree = dp;
  return collective::rank_grid(std::move(axes));
}

expected<shrink_plan> plan_shrink(const collective::rank_grid& grid, int dp, int microbatches,
                                  const elastic_layout& now, const std::vector<int>& lost,
                                  int min_ranks, int zero, bool buddies, int microbatch_multiple) {
  using result = expected<shrink_plan>;
  auto is_lost = [&](int r) { return std::find(lost.begin(), lost.end(), r) != lost.end(); };
  std::string who;
  for (int pos = 0; pos < static_cast<int>(now.positions.size()); ++pos)
    if (is_lost(now.positions[static_cast<std::size_t>(pos)]))
      who += fmt::format("{}rank {} ({})", who.empty() ? "" : ", ",
                         now.positions[static_cast<std::size_t>(pos)], coordinates(grid, pos));
  const int npos = static_cast<int>(now.positions.size());
  if (zero != 0 && (!buddies || grid.world_size() != dp))
    return result::failure(fmt::format(
        "elastic: shrinking after the loss of {} with parallel.zero {} needs {}", who, zero,
        !buddies ? std::string("buddy replicas (elastic.replica_interval): no survivor holds a "
                               "lost rank's shard")
                 : std::string("a plan of data parallelism only (pp = tp = 1)")));
  if (zero != 0)
    for (int pos = 0; pos < npos; ++pos)
      if (is_lost(now.positions[static_cast<std::size_t>(pos)]) &&
          is_lost(now.positions[static_cast<std::size_t>(buddy_holder(pos, npos))]))
        return result::failure(fmt::format(
            "elastic: {} and rank {}, which holds its buddy replica, were lost: no survivor "
            "holds the ZeRO-{} shard of dp rank {}",
            who, now.positions[static_cast<std::size_t>(buddy_holder(pos, npos))], zero,
            grid.coord(pos, "dp")));
  if (now.generation + 1 > 255)
    return result::failure("elastic: 255 recoveries in one run, the most group ids can tell apart");
  // Survivors per piece (its coordinates on every axis but dp: cp, pp, tp), in dp order.
  const int pieces = grid.world_size() / dp;
  auto piece_of = [](const collective::rank_grid& g, int pos) {
    std::vector<int> key;
    for (const auto& a : g.axes())
      if (a.name != "dp") key.push_back(g.coord(pos, a.name));
    return key;
  };
  std::map<std::vector<int>, std::vector<int>> holders;
  for (int pos = 0; pos < grid.world_size(); ++pos) {
    const int r = now.positions[static_cast<std::size_t>(pos)];
    auto& h = holders[piece_of(grid, pos)];
    if (!is_lost(r)) h.push_back(r);
  }
  int most = dp;
  for (const auto& [piece, h] : holders) most = std::min(most, static_cast<int>(h.size()));
  // The most replicas that keep dp x microbatches (the global batch's slots) whole, with
  // micro-batches per replica the schedule can run (a multiple of microbatch_multiple).
  const int slots = dp * microbatches;
  int d = most;
  while (d > 0 && (slots % d != 0 || (slots / d) % std::max(microbatch_multiple, 1) != 0)) --d;
  if (d == 0 || d * pieces < min_ranks)
    return result::failure(fmt::format(
        "elastic: {} was lost and no spare rank is left; shrinking onto the survivors gives {}, "
        "below elastic.min_ranks (--min-ranks) {}",
        who,
        d == 0 ? std::string("no plan: some piece (pp x tp) has no survivor left")
               : fmt::format("at most {} ({} ranks)", plan_text(with_dp(grid, d)), d * pieces),
        min_ranks));
  shrink_plan p;
  p.dp = d;
  p.microbatches = slots / d;
  p.next.generation = now.generation + 1;
  const auto next_grid = with_dp(grid, d);
  for (int q = 0; q < next_grid.world_size(); ++q) {
    const auto& h = holders[piece_of(next_grid, q)];
    p.next.positions.push_back(h[static_cast<std::size_t>(next_grid.coord(q, "dp"))]);
  }
  for (int r : now.positions)
    if (!is_lost(r) && p.next.position_of(r) < 0) p.next.spares.push_back(r);
  for (int r : now.spares)
    if (!is_lost(r)) p.next.spares.push_back(r);
  std::sort(p.next.spares.begin(), p.next.spares.end());
  return p;
}

expected<grow_plan> plan_grow(const collective::rank_grid& grid, int dp, int microbatches,
                              const elastic_layout& now, int target_dp, int microbatch_multiple) {
  using result = expected<grow_plan>;
  const int pieces = grid.world_size() / dp;
  const int ranks = static_cast<int>(now.positions.size() + now.spares.size());
  const int slots = dp * microbatches;
  int d = target_dp;
  while (d > dp && (slots % d != 0 || (slots / d) % std::max(microbatch_multiple, 1) != 0 ||
                    d * pieces > ranks))
    --d;
  if (d <= dp)
    return result::failure(fmt::format(
        "elastic: {} cannot grow: {} spare ranks, the larger plans up to dp{} need {} more "
        "ranks per data-parallel replica and dp dividing the {} micro-batch slots",
        plan_text(grid), now.spares.size(), target_dp, pieces, slots));
  if (now.generation + 1 > 255)
    return result::failure("elastic: 255 recoveries in one run, the most group ids can tell apart");
  auto piece_of = [](const collective::rank_grid& g, int pos) {
    std::vector<int> key;
    for (const auto& a : g.axes())
      if (a.name != "dp") key.push_back(g.coord(pos, a.name));
    return key;
  };
  // The holders of the current grid by (piece, dp coordinate).
  std::map<std::pair<std::vector<int>, int>, int> holder;
  for (int q = 0; q < grid.world_size(); ++q)
    holder[{piece_of(grid, q), grid.coord(q, "dp")}] = now.positions[static_cast<std::size_t>(q)];
  grow_plan p;
  p.dp = d;
  p.microbatches = slots / d;
  p.next.generation = now.generation + 1;
  p.next.spares = now.spares;
  const auto next_grid = with_dp(grid, d);
  for (int q = 0; q < next_grid.world_size(); ++q) {
    const auto key = piece_of(next_grid, q);
    const int c = next_grid.coord(q, "dp");
    if (c < dp) {
      p.next.positions.push_back(holder.at({key, c}));
      continue;
    }
    replacement m;
    m.position = q;
    m.spare = p.next.spares.front();
    m.donor = holder.at({key, 0});
    p.next.spares.erase(p.next.spares.begin());
    p.next.positions.push_back(m.spare);
    p.moves.push_back(m);
  }
  return p;
}

collective::rank_group reshard_group(const std::vector<int>& ranks, int generation) {
  collective::rank_group g;
  // Bit 23 with bit 20 (restore groups: positions below 2^20; buddy groups: bit 21; expert
  // groups: bit 22).
  g.id = group_id_of((1u << 23) | (1u << 20), generation);
  g.ranks = ranks;
  return g;
}

expected<recovery_plan> plan_replacement(const collective::rank_grid& grid,
                                         const elastic_layout& now, const std::vector<int>& lost) {
  using result = expected<recovery_plan>;
  auto is_lost = [&](int r) { return std::find(lost.begin(), lost.end(), r) != lost.end(); };
  auto started = next_generation(now, lost);
  if (!started) return started;
  recovery_plan p = std::move(*started);
  for (int pos = 0; pos < static_cast<int>(now.positions.size()); ++pos) {
    const int r = now.positions[static_cast<std::size_t>(pos)];
    if (!is_lost(r)) continue;
    if (p.next.spares.empty())
      return result::failure(fmt::format("elastic: rank {} ({}) was lost and no spare rank is left",
                                         r, coordinates(grid, pos)));
    replacement m;
    m.position = pos;
    m.lost = r;
    m.spare = p.next.spares.front();
    p.next.spares.erase(p.next.spares.begin());
    p.next.positions[static_cast<std::size_t>(pos)] = m.spare;
    p.moves.push_back(m);
  }
  return p;
}

std::uint32_t group_id_of(std::uint32_t base, int generation) {
  TROUPE_CHECK(base < (1u << 24) && generation >= 0 && generation < 256, "elastic: group id ", base,
               " of generation ", generation, " does not fit 32 bits");
  return base | (static_cast<std::uint32_t>(generation) << 24);
}

collective::rank_group restore_group(int position, int donor, int spare, int generation) {
  collective::rank_group g;
  // The grid's ids hold an axis mask below bit 23 (at most 3 axes: bits 20-22); bit 23 marks
  // restore groups, the low bits the position.
  g.id = group_id_of((1u << 23) | static_cast<std::uint32_t>(position), generation);
  g.ranks = {donor, spare};
  return g;
}

collective::rank_group buddy_group(int from, int sender, int receiver, int generation) {
  collective::rank_group g;
  // Bit 23 with bit 21: buddy groups (restore groups have bit 21 clear: positions < 2^20).
  g.id = group_id_of((1u << 23) | (1u << 21) | static_cast<std::uint32_t>(from), generation);
  g.ranks = {sender, receiver};
  return g;
}

collective::rank_group elastic_group(const collective::rank_grid& grid,
                                     const elastic_layout& layout, int position,
                                     const std::vector<std::string>& axes) {
  auto g = grid.group(position, axes);
  for (auto& r : g.ranks) r = layout.positions.at(static_cast<std::size_t>(r));
  g.id = group_id_of(g.id, layout.generation);
  return g;
}

}  // namespace troupe::actors
