// The named rank grid (see grid.hpp).
#include "collective/grid.hpp"

#include <algorithm>
#include <set>
#include <sstream>

#include "memory/error.hpp"

namespace troupe::collective {

int rank_group::index_of(int world_rank) const {
  auto it = std::find(ranks.begin(), ranks.end(), world_rank);
  return it == ranks.end() ? -1 : static_cast<int>(it - ranks.begin());
}

rank_grid::rank_grid(std::vector<grid_axis> axes) : axes_(std::move(axes)) {
  TROUPE_CHECK(!axes_.empty(), "rank grid: at least one axis is needed");
  std::set<std::string> names;
  for (const auto& a : axes_) {
    TROUPE_CHECK(!a.name.empty(), "rank grid: an axis has an empty name");
    TROUPE_CHECK(names.insert(a.name).second, "rank grid: axis '", a.name, "' appears twice");
    TROUPE_CHECK(a.degree >= 1, "rank grid: degree of axis '", a.name, "' is ", a.degree,
                 ", must be >= 1");
    TROUPE_CHECK(world_ <= (1 << 20) / a.degree, "rank grid: too many ranks");
    world_ *= a.degree;
  }
}

int rank_grid::degree(const std::string& axis) const {
  for (const auto& a : axes_)
    if (a.name == axis) return a.degree;
  return 1;
}

std::vector<int> rank_grid::coords(int rank) const {
  TROUPE_CHECK(rank >= 0 && rank < world_, "rank grid: rank ", rank, " outside world of ", world_);
  std::vector<int> c(axes_.size());
  for (std::size_t i = axes_.size(); i-- > 0;) {
    c[i] = rank % axes_[i].degree;
    rank /= axes_[i].degree;
  }
  return c;
}

int rank_grid::coord(int rank, const std::string& axis) const {
  auto c = coords(rank);
  for (std::size_t i = 0; i < axes_.size(); ++i)
    if (axes_[i].name == axis) return c[i];
  return 0;
}

int rank_grid::rank_of(const std::vector<int>& c) const {
  TROUPE_CHECK(c.size() == axes_.size(), "rank grid: ", c.size(), " coordinates for ", axes_.size(),
               " axes");
  int r = 0;
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    TROUPE_CHECK(c[i] >= 0 && c[i] < axes_[i].degree, "rank grid: coordinate ", c[i],
                 " outside axis '", axes_[i].name, "' of degree ", axes_[i].degree);
    r = r * axes_[i].degree + c[i];
  }
  return r;
}

rank_group rank_grid::group(int rank, const std::vector<std::string>& names) const {
  std::vector<bool> chosen(axes_.size(), false);
  for (const auto& n : names) {
    auto it =
        std::find_if(axes_.begin(), axes_.end(), [&](const grid_axis& a) { return a.name == n; });
    TROUPE_CHECK(it != axes_.end(), "rank grid: no axis named '", n, "' in ", describe());
    chosen[it - axes_.begin()] = true;
  }
  auto base = coords(rank);
  // Group id: the axis-set mask in the high bits, the fixed coordinates' index in the low bits.
  std::uint32_t mask = 0, fixed_index = 0;
  for (std::size_t i = 0; i < axes_.size(); ++i) {
    if (chosen[i]) {
      mask |= 1u << i;
    } else {
      fixed_index = fixed_index * static_cast<std::uint32_t>(axes_[i].degree) + base[i];
    }
  }
  rank_group g;
  g.id = (mask << 20) | fixed_index;
  // Enumerate members in row-major order over the chosen axes.
  std::vector<int> c = base;
  std::vector<std::size_t> free;
  for (std::size_t i = 0; i < axes_.size(); ++i)
    if (chosen[i]) {
      free.push_back(i);
      c[i] = 0;
    }
  while (true) {
    g.ranks.push_back(rank_of(c));
    std::size_t k = free.size();
    while (k > 0) {
      auto ax = free[k - 1];
      if (++c[ax] < axes_[ax].degree) break;
      c[ax] = 0;
      --k;
    }
    if (k == 0) break;
  }
  return g;
}

std::vector<rank_group> rank_grid::groups(const std::vector<std::string>& names) const {
  std::vector<rank_group> out;
  std::vector<bool> seen(world_, false);
  for (int r = 0; r < world_; ++r) {
    if (seen[r]) continue;
    auto g = group(r, names);
    for (int m : g.ranks) seen[m] = true;
    out.push_back(std::move(g));
  }
  return out;
}

std::string rank_grid::describe() const {
  std::ostringstream os;
  for (std::size_t i = 0; i < axes_.size(); ++i)
    os << (i ? " x " : "") << axes_[i].name << axes_[i].degree;
  return os.str();
}

}  // namespace troupe::collective
