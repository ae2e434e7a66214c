// Tests of the named rank grid against an independent enumeration.
#include <catch2/catch.hpp>

#include <set>

#include "collective/grid.hpp"
#include "memory/error.hpp"

using troupe::collective::rank_grid;

TEST_CASE("rank grid coordinates are row major with the first axis slowest", "[collective]") {
  rank_grid g({{"dp", 2}, {"pp", 3}, {"tp", 2}});
  REQUIRE(g.world_size() == 12);
  for (int r = 0; r < 12; ++r) {
    auto c = g.coords(r);
    REQUIRE(c[0] == r / 6);
    REQUIRE(c[1] == (r / 2) % 3);
    REQUIRE(c[2] == r % 2);
    REQUIRE(g.rank_of(c) == r);
  }
  REQUIRE(g.describe() == "dp2 x pp3 x tp2");
  REQUIRE(g.degree("ep") == 1);
}

TEST_CASE("rank grid groups partition the world and agree between members", "[collective]") {
  rank_grid g({{"dp", 2}, {"pp", 2}, {"tp", 2}});
  for (std::vector<std::string> axes :
       {std::vector<std::string>{"tp"}, {"dp"}, {"pp"}, {"dp", "tp"}, {"dp", "pp", "tp"}}) {
    auto gs = g.groups(axes);
    std::set<int> all;
    std::set<std::uint32_t> ids;
    for (const auto& grp : gs) {
      ids.insert(grp.id);
      for (std::size_t i = 0; i < grp.ranks.size(); ++i) {
        int r = grp.ranks[i];
        REQUIRE(all.insert(r).second);
        auto again = g.group(r, axes);
        REQUIRE(again.id == grp.id);
        REQUIRE(again.ranks == grp.ranks);
        REQUIRE(again.index_of(r) == static_cast<int>(i));
        // Members differ from the first member only along the chosen axes.
        auto c0 = g.coords(grp.ranks[0]), c = g.coords(r);
        for (std::size_t a = 0; a < g.axes().size(); ++a) {
          bool chosen = std::find(axes.begin(), axes.end(), g.axes()[a].name) != axes.end();
          if (!chosen) REQUIRE(c[a] == c0[a]);
        }
      }
    }
    REQUIRE(all.size() == 8);
    REQUIRE(ids.size() == gs.size());
  }
  // tp groups of a dp2 x pp2 x tp2 grid are consecutive pairs.
  REQUIRE(g.group(5, {"tp"}).ranks == std::vector<int>{4, 5});
  REQUIRE(g.group(5, {"dp"}).ranks == std::vector<int>{1, 5});
  REQUIRE(g.group(0, {"tp"}).id != g.group(0, {"dp"}).id);
}

TEST_CASE("rank grid rejects bad degrees and unknown axes with the field named", "[collective]") {
  using Catch::Contains;
  REQUIRE_THROWS_WITH(rank_grid({{"dp", 0}}), Contains("degree of axis 'dp'"));
  REQUIRE_THROWS_WITH(rank_grid({{"dp", 2}, {"dp", 2}}), Contains("'dp' appears twice"));
  rank_grid g({{"dp", 2}, {"tp", 2}});
  REQUIRE_THROWS_WITH(g.group(0, {"pp"}), Contains("no axis named 'pp'"));
  REQUIRE_THROWS_WITH(g.coords(4), Contains("rank 4 outside"));
}
