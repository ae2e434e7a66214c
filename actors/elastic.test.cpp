// Elastic bookkeeping (elastic.hpp) and the rebindable communicator (rebindable_communicator.hpp):
// which spare fills which lost position and who sends it the state, the group ids of each
// generation, and a communicator put under a piece after its old one was aborted.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstdio>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "actors/elastic.hpp"
#include "actors/rebindable_communicator.hpp"
#include "collective/local/local_transport.hpp"

using namespace troupe;
using namespace troupe::actors;

namespace {

collective::rank_grid dp_pp(int dp, int pp) {
  return collective::rank_grid({{"dp", dp}, {"pp", pp}, {"tp", 1}});
}

}  // namespace

TEST_CASE("A lost position gets the lowest spare and a replica of its piece as donor",
          "[elastic]") {
  const auto grid = dp_pp(2, 2);  // positions: 0 (dp0 pp0), 1 (dp0 pp1), 2 (dp1 pp0), 3 (dp1 pp1)
  const auto now = elastic_layout::initial(4, 6);
  REQUIRE(now.spares == std::vector<int>{4, 5});
  auto p = plan_recovery(grid, now, {3}, 0);
  REQUIRE(p);
  REQUIRE(p->moves.size() == 1);
  CHECK(p->moves[0].position == 3);
  CHECK(p->moves[0].lost == 3);
  CHECK(p->moves[0].spare == 4);
  CHECK(p->moves[0].donor == 1);  // dp 0 pp 1: the same stage
  CHECK(p->next.positions == std::vector<int>{0, 1, 2, 4});
  CHECK(p->next.spares == std::vector<int>{5});
  CHECK(p->next.generation == 1);
  CHECK(p->next.position_of(4) == 3);
  CHECK(p->next.position_of(3) == -1);

  // Next generation: the promoted spare and a lost spare at once.
  auto q = plan_recovery(grid, p->next, {0, 5}, 0);
  REQUIRE(!q);
  CHECK(q.error_message().find("rank 0 (dp 0 pp 0 tp 0) was lost and no spare rank is left") !=
        std::string::npos);
}

TEST_CASE("A piece without a surviving replica cannot be restored, naming why", "[elastic]") {
  const auto grid = dp_pp(2, 2);
  const auto now = elastic_layout::initial(4, 6);
  auto both = plan_recovery(grid, now, {1, 3}, 0);  // both replicas of stage 1
  REQUIRE(!both);
  CHECK(both.error_message().find(
            "rank 1 (dp 0 pp 1 tp 0) was lost and no survivor holds its "
            "piece (every data-parallel replica of it is lost, or dp is 1)") != std::string::npos);
  auto zero = plan_recovery(grid, now, {2}, 1);
  REQUIRE(!zero);
  CHECK(zero.error_message().find("parallel.zero 1 shards its state") != std::string::npos);
  // Two lost positions of different stages, each with a replica left: two spares, two donors.
  auto two = plan_recovery(grid, now, {0, 3}, 0);
  REQUIRE(two);
  REQUIRE(two->moves.size() == 2);
  CHECK(two->moves[0].spare == 4);
  CHECK(two->moves[0].donor == 2);
  CHECK(two->moves[1].spare == 5);
  CHECK(two->moves[1].donor == 1);
}

TEST_CASE("Without a replica a lost position takes its state from its buddy", "[elastic]") {
  const auto grid = dp_pp(1, 3);  // positions 0, 1, 2: stages; position p + 1 holds p's buddy copy
  const auto now = elastic_layout::initial(3, 4);
  CHECK(buddy_holder(2, 3) == 0);
  auto p = plan_recovery(grid, now, {1}, 0, true);
  REQUIRE(p);
  CHECK(p->moves[0].donor == 2);
  CHECK(p->moves[0].buddy);
  CHECK(p->moves[0].spare == 3);
  // A data-parallel replica comes first.
  auto dp = plan_recovery(dp_pp(2, 1), elastic_layout::initial(2, 3), {1}, 0, true);
  REQUIRE(dp);
  CHECK(dp->moves[0].donor == 0);
  CHECK(!dp->moves[0].buddy);
  // The piece and its buddy holder both lost.
  auto both = plan_recovery(grid, elastic_layout::initial(3, 5), {1, 2}, 0, true);
  REQUIRE(!both);
  CHECK(both.error_message().find("rank 2, which holds its buddy replica, was lost too") !=
        std::string::npos);
  // Without buddies, no way.
  CHECK(!plan_recovery(grid, now, {1}, 0, false));
}

TEST_CASE("Group ids differ between generations and from restore groups", "[elastic]") {
  const auto grid = dp_pp(2, 2);
  auto layout = elastic_layout::initial(4, 5);
  std::set<std::uint32_t> ids;
  for (int gen = 0; gen < 3; ++gen) {
    layout.generation = gen;
    for (int pos = 0; pos < 4; ++pos)
      for (const auto& axes : std::vector<std::vector<std::string>>{{"dp"}, {"pp"}, {"pp", "tp"}}) {
        const auto g = elastic_group(grid, layout, pos, axes);
        // Members of one group agree on its id: count each group once.
        if (g.ranks.front() == layout.positions[static_cast<std::size_t>(pos)]) ids.insert(g.id);
        CHECK((g.id >> 24) == static_cast<std::uint32_t>(gen));
      }
    ids.insert(restore_group(3, 1, 4, gen).id);
    ids.insert(buddy_group(3, 4, 0, gen).id);
  }
  // Per generation: 2 dp groups, 2 pp groups, 2 mp groups, 1 restore group, 1 buddy group.
  CHECK(ids.size() == 3 * 8);
  // Generation 0 keeps the grid's own ids (a run without losses talks as before).
  layout.generation = 0;
  CHECK(elastic_group(grid, layout, 1, {"dp"}).id == grid.group(1, {"dp"}).id);
  // A replaced position maps its group to the spare's rank.
  layout.positions = {0, 1, 2, 4};
  CHECK(elastic_group(grid, layout, 1, {"dp"}).ranks == std::vector<int>{1, 4});
  CHECK_THROWS(group_id_of(1, 256));
}

TEST_CASE("A rebindable communicator goes on over a new communicator after an abort", "[elastic]") {
  auto old_world = std::make_shared<collective::local_world>(2);
  auto olds = collective::make_local_group(old_world, 1);
  std::vector<std::unique_ptr<rebindable_communicator>> comms;
  for (auto& c : olds) comms.push_back(std::make_unique<rebindable_communicator>(std::move(c)));
  // A loss elsewhere: both abort, and ops fail at once, naming it.
  for (auto& c : comms) c->abort("rank 7 was lost");
  float x = 1;
  CHECK_THROWS_WITH(comms[0]->allreduce(&x, 1, dtype::f32).wait(),
                    Catch::Contains("rank 7 was lost"));
  // The next generation's communicators under the same objects: allreduce works again.
  auto new_world = std::make_shared<collective::local_world>(2);
  auto news = collective::make_local_group(new_world, 2);
  for (std::size_t i = 0; i < 2; ++i) comms[i]->rebind(std::move(news[i]));
  float v[2] = {1, 2};
  std::thread t([&] { comms[1]->allreduce(&v[1], 1, dtype::f32).wait(); });
  comms[0]->allreduce(&v[0], 1, dtype::f32).wait();
  t.join();
  CHECK(v[0] == 3);
  CHECK(v[1] == 3);
  // Another shape is refused unless asked for.
  auto three = collective::make_local_group(3);
  CHECK_THROWS_WITH(comms[0]->rebind(std::move(three[0])), Catch::Contains("was rank 0 of 2"));
  auto one = collective::make_local_group(1);
  comms[0]->rebind(std::move(one[0]), true);
  CHECK(comms[0]->size() == 1);
}

TEST_CASE("With no spare a dp2 x pp2 job that lost a stage shrinks to dp1 x pp2 on survivors",
          "[elastic]") {
  const auto grid = dp_pp(2, 2);  // positions: 0 (dp0 pp0), 1 (dp0 pp1), 2 (dp1 pp0), 3 (dp1 pp1)
  const auto now = elastic_layout::initial(4, 4);
  auto s = plan_shrink(grid, 2, 2, now, {3}, 2, 0);
  REQUIRE(s);
  CHECK(s->dp == 1);
  CHECK(s->microbatches == 4);  // dp x microbatches stays 4: the global batch's slots
  CHECK(s->next.generation == 1);
  // Position 0 (pp0) stays with rank 0, position 1 (pp1) with rank 1, its only survivor.
  CHECK(s->next.positions == std::vector<int>{0, 1});
  CHECK(s->next.spares == std::vector<int>{2});  // the surviving pp0 replica idles
  // Rank 1 lost instead: pp1's survivor is rank 3.
  auto t = plan_shrink(grid, 2, 2, now, {1}, 0, 0);
  REQUIRE(t);
  CHECK(t->next.positions == std::vector<int>{0, 3});
  CHECK(t->next.spares == std::vector<int>{2});
}

TEST_CASE("A dp4 job shrinks to the most replicas that divide its micro-batch slots", "[elastic]") {
  const auto grid = dp_pp(4, 1);
  const auto now = elastic_layout::initial(4, 4);
  // 3 survivors, 4 slots (dp4 x 1 micro-batch): dp3 would not split them evenly, dp2 does.
  auto s = plan_shrink(grid, 4, 1, now, {2}, 1, 0);
  REQUIRE(s);
  CHECK(s->dp == 2);
  CHECK(s->microbatches == 2);
  CHECK(s->next.positions == std::vector<int>{0, 1});
  CHECK(s->next.spares == std::vector<int>{3});
  // 12 slots (dp4 x 3): dp3 keeps them whole with 4 micro-batches each.
  auto t = plan_shrink(grid, 4, 3, now, {0}, 3, 0);
  REQUIRE(t);
  CHECK(t->dp == 3);
  CHECK(t->microbatches == 4);
  CHECK(t->next.positions == std::vector<int>{1, 2, 3});
  CHECK(t->next.spares.empty());
}

TEST_CASE("A shrink below elastic.min_ranks or of a ZeRO shard is refused, naming the setting",
          "[elastic][faults]") {
  const auto grid = dp_pp(2, 2);
  const auto now = elastic_layout::initial(4, 4);
  auto s = plan_shrink(grid, 2, 2, now, {3}, 3, 0);
  REQUIRE_FALSE(s);
  CHECK(s.error_message().find("elastic.min_ranks (--min-ranks) 3") != std::string::npos);
  CHECK(s.error_message().find("at most dp1 x pp2") != std::string::npos);
  CHECK(s.error_message().find("rank 3 (dp 1 pp 1 tp 0)") != std::string::npos);
  std::printf("faults: shrink of dp2 x pp2 below min_ranks 3 -> refused: %s\n",
              s.error_message().c_str());
  // Both replicas of a stage lost: no plan keeps the model whole.
  auto none = plan_shrink(grid, 2, 2, now, {1, 3}, 2, 0);
  REQUIRE_FALSE(none);
  CHECK(none.error_message().find("no survivor left") != std::string::npos);
  const auto four = elastic_layout::initial(4, 4);
  auto zero = plan_shrink(dp_pp(4, 1), 4, 1, four, {1}, 1, 1);
  REQUIRE_FALSE(zero);
  CHECK(zero.error_message().find("buddy replicas (elastic.replica_interval)") !=
        std::string::npos);
  // With buddy replicas: rank 1's shard is on rank 2; lost together, none is left.
  REQUIRE(plan_shrink(dp_pp(4, 1), 4, 1, four, {1}, 1, 1, true));
  auto pair = plan_shrink(dp_pp(4, 1), 4, 1, four, {1, 2}, 1, 1, true);
  REQUIRE_FALSE(pair);
  CHECK(pair.error_message().find("no survivor holds the ZeRO-1 shard of dp rank 1") !=
        std::string::npos);
  auto staged = plan_shrink(grid, 2, 2, now, {3}, 2, 1, true);
  REQUIRE_FALSE(staged);
  CHECK(staged.error_message().find("pp = tp = 1") != std::string::npos);
}

TEST_CASE("The disk fallback puts the lowest spares in the lost positions, without donors",
          "[elastic]") {
  const auto grid = dp_pp(1, 3);
  elastic_layout now = elastic_layout::initial(3, 6);  // spares 3, 4, 5
  now.generation = 2;
  auto p = plan_replacement(grid, now, {2, 1, 4});  // spare 4 lost too
  REQUIRE(p);
  CHECK(p->next.generation == 3);
  CHECK(p->next.positions == std::vector<int>{0, 3, 5});
  CHECK(p->next.spares.empty());
  REQUIRE(p->moves.size() == 2);
  CHECK(p->moves[0].position == 1);
  CHECK(p->moves[0].lost == 1);
  CHECK(p->moves[0].donor == -1);
  CHECK(p->moves[1].spare == 5);
  auto short_of = plan_replacement(grid, elastic_layout::initial(3, 4), {1, 2});
  REQUIRE(!short_of);
  CHECK(short_of.error_message().find("rank 2 (dp 0 pp 2 tp 0) was lost and no spare rank is "
                                      "left") != std::string::npos);
}

TEST_CASE("A dp2 x cp2 job that lost a rank shrinks to dp1 with each cp position on a survivor",
          "[elastic]") {
  // Positions: 0 (dp0 cp0), 1 (dp0 cp1), 2 (dp1 cp0), 3 (dp1 cp1). The cp positions are
  // different pieces: each reads its own part of every sequence.
  const collective::rank_grid grid({{"dp", 2}, {"cp", 2}, {"pp", 1}, {"tp", 1}});
  const auto now = elastic_layout::initial(4, 4);
  auto s = plan_shrink(grid, 2, 1, now, {3}, 2, 0);
  REQUIRE(s);
  CHECK(s->dp == 1);
  CHECK(s->microbatches == 2);
  CHECK(s->next.positions == std::vector<int>{0, 1});  // each rank in one position only
  CHECK(s->next.spares == std::vector<int>{2});
}

TEST_CASE("An interleaved pipeline shrinks to micro-batches per replica that are a multiple of pp",
          "[elastic]") {
  // dp3 x pp2 with 2 micro-batches: 6 slots. dp2 would take 3 micro-batches each, which the
  // interleaved schedule refuses (scheduler::validate: a multiple of pp); dp1 takes 6.
  const auto grid = dp_pp(3, 2);
  const auto now = elastic_layout::initial(6, 6);
  auto s = plan_shrink(grid, 3, 2, now, {5}, 2, 0, false, 2);
  REQUIRE(s);
  CHECK(s->dp == 1);
  CHECK(s->microbatches == 6);
  CHECK(s->next.positions == std::vector<int>{0, 1});
  // Other schedules take dp2 x 3.
  auto t = plan_shrink(grid, 3, 2, now, {5}, 2, 0);
  REQUIRE(t);
  CHECK(t->dp == 2);
  CHECK(t->microbatches == 3);
}

TEST_CASE("A spare passed over by one recovery takes its place at the next one's generation",
          "[elastic]") {
  // dp2 with spares 2 and 3. Rank 0 is lost: rank 2 takes its place at generation 1; the driver
  // asks only the new positions' ranks, so rank 3 still holds generation 0's layout.
  const auto grid = dp_pp(2, 1);
  const auto rank3 = elastic_layout::initial(2, 4);
  auto first = plan_recovery(grid, rank3, {0}, 0);
  REQUIRE(first);
  REQUIRE(first->next.positions == std::vector<int>{2, 1});
  CHECK(takes_generation(rank3, 2, 1));
  // Rank 1 is lost next: rank 3 takes its place at generation 2, from its layout of generation 0.
  auto second = plan_recovery(grid, first->next, {1}, 0);
  REQUIRE(second);
  REQUIRE(second->next.positions == std::vector<int>{2, 3});
  REQUIRE(second->next.generation == 2);
  CHECK(takes_generation(rank3, 3, second->next.generation));
  // A rank holding a position was in every generation since: it takes the next one only.
  CHECK(takes_generation(first->next, 2, 2));
  CHECK_FALSE(takes_generation(first->next, 2, 3));
  CHECK_FALSE(takes_generation(rank3, 3, 0));
}

TEST_CASE("A joiner in a lost rank's number stays a spare and takes the lost place", "[elastic]") {
  // dp2 x pp2 with no spare; rank 3 is lost and a joiner (troupe launch --join) takes its number:
  // the layout lists 3 both as the lost holder of position 3 and as a spare.
  const auto grid = dp_pp(2, 2);
  auto now = elastic_layout::initial(4, 4);
  REQUIRE(!plan_recovery(grid, now, {3}, 0));  // no spare yet
  now.spares = {3};
  auto p = plan_recovery(grid, now, {3}, 0);
  REQUIRE(p);
  REQUIRE(p->moves.size() == 1);
  CHECK(p->moves[0].position == 3);
  CHECK(p->moves[0].lost == 3);
  CHECK(p->moves[0].spare == 3);  // the new process
  CHECK(p->moves[0].donor == 1);  // dp 0 pp 1: the same stage
  CHECK(p->next.positions == std::vector<int>{0, 1, 2, 3});
  CHECK(p->next.spares.empty());
  // A lost spare that holds no position is still dropped.
  auto q = elastic_layout::initial(4, 6);
  auto r = plan_recovery(grid, q, {2, 4}, 0);
  REQUIRE(r);
  CHECK(r->moves[0].spare == 5);
  CHECK(r->next.spares.empty());
}

TEST_CASE("A shrunk dp1 x pp2 job with two idle ranks grows back to dp2 x pp2", "[elastic]") {
  // After the shrink of the test above (rank 3 lost): dp1 x pp2 on ranks 0 and 1, micro-batches
  // 4, rank 2 idle; a joiner took rank 3's number.
  const auto grid = dp_pp(1, 2);
  elastic_layout now;
  now.positions = {0, 1};
  now.spares = {2, 3};
  now.generation = 1;
  auto g = plan_grow(grid, 1, 4, now, 2);
  REQUIRE(g);
  CHECK(g->dp == 2);
  CHECK(g->microbatches == 2);  // dp x microbatches stays 4
  CHECK(g->next.generation == 2);
  // Positions 0 (dp0 pp0) and 1 (dp0 pp1) keep their holders; 2 (dp1 pp0) and 3 (dp1 pp1) go to
  // the spares, their state from the dp 0 holder of the same stage.
  CHECK(g->next.positions == std::vector<int>{0, 1, 2, 3});
  CHECK(g->next.spares.empty());
  REQUIRE(g->moves.size() == 2);
  CHECK(g->moves[0].position == 2);
  CHECK(g->moves[0].spare == 2);
  CHECK(g->moves[0].donor == 0);
  CHECK(g->moves[1].position == 3);
  CHECK(g->moves[1].spare == 3);
  CHECK(g->moves[1].donor == 1);
  // One idle rank is not a whole replica of two stages: no growth, saying why.
  now.spares = {3};
  auto none = plan_grow(grid, 1, 4, now, 2);
  REQUIRE(!none);
  CHECK(none.error_message().find("dp1 x pp2 cannot grow: 1 spare ranks") != std::string::npos);
}

TEST_CASE("Growing takes the largest dp that divides the micro-batch slots and the ranks fill",
          "[elastic]") {
  const auto grid = collective::rank_grid({{"dp", 2}, {"pp", 1}, {"tp", 1}});
  elastic_layout now;
  now.positions = {0, 1};
  now.spares = {2, 3, 5};
  // dp2 x 2 micro-batches: 4 slots; dp3 would split them unevenly, dp4 fits 5 ranks.
  auto g = plan_grow(grid, 2, 2, now, 4);
  REQUIRE(g);
  CHECK(g->dp == 4);
  CHECK(g->microbatches == 1);
  CHECK(g->next.positions == std::vector<int>{0, 1, 2, 3});
  CHECK(g->next.spares == std::vector<int>{5});
  CHECK(g->moves[0].donor == 0);
  CHECK(g->moves[1].donor == 0);
  // Not beyond the plan it started with, nor to micro-batches the schedule cannot run.
  CHECK(!plan_grow(grid, 2, 2, now, 2));
  CHECK(!plan_grow(grid, 2, 2, now, 4, 2));  // dp4 x 1 micro-batch is not a multiple of 2
}
