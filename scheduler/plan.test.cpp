// Parallel plans: every rule, every problem reported at once, each naming its field.
#include <catch2/catch.hpp>

#include "scheduler/plan.hpp"

using namespace troupe::scheduler;

namespace {
// A Llama-like shape: 16 layers, 32 heads (8 kv), hidden 4096, vocab 32000, seq 2048, batch 64.
model_shape llama() {
  return {16, 32, 8, 4096, 32000, 2048, 64};
}
}  // namespace

TEST_CASE("a consistent plan has no problems") {
  parallel_plan p;
  p.dp = 2, p.tp = 2, p.pp = 2, p.sp = true, p.zero = 1, p.microbatches = 8;
  p.schedule = schedule_kind::interleaved;
  p.virtual_stages = 2;
  CHECK(validate(p, llama(), 8).empty());
  CHECK(validate(parallel_plan{}, llama(), 1).empty());
  CHECK(validate(parallel_plan{}, {}, 0).empty());
}

TEST_CASE("a tensor-parallel degree that does not divide the heads is named with both numbers") {
  parallel_plan p;
  p.tp = 3;
  model_shape m{4, 8, 8, 0, 0, 0, 0};
  CHECK(validate(p, m, 3) ==
        std::vector<std::string>{"parallel.tp = 3 does not divide heads = 8",
                                 "parallel.tp = 3 does not divide kv_heads = 8"});
}

TEST_CASE("every problem of a plan is reported not only the first") {
  parallel_plan p;
  p.dp = 3, p.tp = 5, p.pp = 4, p.sp = true, p.zero = 4, p.microbatches = 6;
  p.schedule = schedule_kind::interleaved;
  p.virtual_stages = 1;
  p.order = {"dp", "tp", "tp"};
  model_shape m{6, 32, 8, 4096, 32000, 2048, 64};
  const std::vector<std::string> want = {
      "parallel.dp x parallel.tp x parallel.pp = 3 x 5 x 4 = 60 does not equal the world size 8",
      "parallel.zero = 4 must be 0, 1, 2 or 3",
      "parallel.virtual_stages = 1 must be >= 2 for parallel.schedule = \"interleaved\"",
      "parallel.microbatches = 6 must be a multiple of parallel.pp = 4 for parallel.schedule = "
      "\"interleaved\"",
      "parallel.order = [\"dp\", \"tp\", \"tp\"] must name each of \"dp\", \"pp\" and \"tp\" "
      "exactly once",
      "parallel.tp = 5 does not divide heads = 32",
      "parallel.tp = 5 does not divide kv_heads = 8",
      "parallel.tp = 5 does not divide hidden = 4096",
      "parallel.tp = 5 does not divide seq = 2048 (needed by parallel.sp = true)",
      "parallel.dp = 3 does not divide the global batch = 64",
  };
  CHECK(validate(p, m, 8) == want);
  CHECK(join(want).find("; parallel.zero = 4") != std::string::npos);
}

TEST_CASE("each rule of a plan fails on its own") {
  struct bad {
    parallel_plan plan;
    model_shape shape;
    int world;
    const char* says;
  };
  auto plan = [](auto edit) {
    parallel_plan p;
    edit(p);
    return p;
  };
  const std::vector<bad> cases = {
      {plan([](auto& p) { p.dp = 0; }), {}, 0, "parallel.dp = 0 must be >= 1"},
      {plan([](auto& p) { p.tp = -1; }), {}, 0, "parallel.tp = -1 must be >= 1"},
      {plan([](auto& p) { p.pp = 0; }), {}, 0, "parallel.pp = 0 must be >= 1"},
      {plan([](auto& p) { p.pp = 2; }),
       {},
       4,
       "parallel.dp x parallel.tp x parallel.pp = 1 x 1 x 2 = 2 does not equal the world size 4"},
      {plan([](auto& p) { p.sp = true; }), {}, 0, "parallel.sp = true needs parallel.tp > 1"},
      {plan([](auto& p) { p.zero = -1; }), {}, 0, "parallel.zero = -1 must be 0, 1, 2 or 3"},
      {plan([](auto& p) { p.microbatches = 0; }), {}, 0, "parallel.microbatches = 0 must be >= 1"},
      {plan([](auto& p) { p.virtual_stages = 2; }),
       {},
       0,
       "parallel.virtual_stages = 2 needs parallel.schedule = \"interleaved\" (parallel.schedule "
       "= \"1f1b\")"},
      {plan([](auto& p) {
         p.schedule = schedule_kind::zero_bubble;
         p.virtual_stages = 2;
       }),
       {},
       0,
       "parallel.virtual_stages = 2 needs parallel.schedule = \"interleaved\" (parallel.schedule "
       "= \"zero-bubble\")"},
      {plan([](auto& p) {
         p.schedule = schedule_kind::interleaved;
         p.virtual_stages = 2;
       }),
       {},
       0,
       "parallel.schedule = \"interleaved\" needs parallel.pp >= 2"},
      {plan([](auto& p) {
         p.order = {"dp", "pp"};
       }),
       {},
       0,
       "parallel.order = [\"dp\", \"pp\"] must name each of"},
      {plan([](auto& p) { p.tp = 2; }),
       {0, 0, 0, 0, 50257, 0, 0},
       0,
       "parallel.tp = 2 does not divide vocab = 50257"},
      {plan([](auto& p) { p.pp = 4; }),
       {3, 0, 0, 0, 0, 0, 0},
       0,
       "parallel.pp x parallel.virtual_stages = 4 x 1 = 4 exceeds layers = 3"},
      {plan([](auto& p) {
         p.pp = 4, p.virtual_stages = 3, p.microbatches = 4;
         p.schedule = schedule_kind::interleaved;
       }),
       {8, 0, 0, 0, 0, 0, 0},
       0,
       "parallel.pp x parallel.virtual_stages = 4 x 3 = 12 exceeds layers = 8"},
      {plan([](auto& p) { p.dp = 4, p.microbatches = 3; }),
       {0, 0, 0, 0, 0, 0, 32},
       0,
       "parallel.microbatches = 3 does not divide the batch per data-parallel rank = 8 (global "
       "batch 32 / parallel.dp 4)"},
      {plan([](auto& p) { p.dp_bucket_bytes = 3; }),
       {},
       0,
       "parallel.dp_bucket_bytes = 3 must be at least 4 (one f32 gradient)"},
      {plan([](auto& p) { p.pipe_p2p = p2p_mode::blocking; }),
       {},
       0,
       "parallel.pipe_p2p = \"blocking\" is the simulator's only: pipeline stages run \"async\" "
       "or \"batched\""},
  };
  for (const auto& c : cases) {
    INFO(c.says);
    auto problems = validate(c.plan, c.shape, c.world);
    REQUIRE(problems.size() == 1);
    CHECK_THAT(problems[0], Catch::StartsWith(c.says));
  }
}

TEST_CASE("schedule recompute partition and p2p mode names round trip") {
  for (auto k : {schedule_kind::gpipe, schedule_kind::one_f_one_b, schedule_kind::interleaved,
                 schedule_kind::eager_1f1b, schedule_kind::zero_bubble})
    CHECK(parse_schedule_kind(name(k)) == k);
  CHECK(name(schedule_kind::zero_bubble) == "zero-bubble");
  for (auto r : {recompute_policy::none, recompute_policy::selective, recompute_policy::full})
    CHECK(parse_recompute_policy(name(r)) == r);
  CHECK(name(schedule_kind::one_f_one_b) == "1f1b");
  CHECK(!parse_schedule_kind("1F1B"));
  CHECK(!parse_recompute_policy("all"));
  for (auto k : {partition_kind::even, partition_kind::balanced})
    CHECK(parse_partition_kind(name(k)) == k);
  CHECK(!parse_partition_kind("uniform"));
  CHECK(parallel_plan{}.partition == partition_kind::balanced);
  for (auto m : {p2p_mode::batched, p2p_mode::blocking, p2p_mode::async})
    CHECK(parse_p2p_mode(name(m)) == m);
  CHECK(!parse_p2p_mode("sync"));
  CHECK(parallel_plan{}.pipe_p2p == p2p_mode::async);
}

TEST_CASE("describe lists the axes in grid order") {
  parallel_plan p;
  p.dp = 2, p.pp = 4, p.tp = 8, p.sp = true, p.zero = 1, p.microbatches = 8;
  p.schedule = schedule_kind::interleaved;
  p.virtual_stages = 2;
  p.recompute = recompute_policy::selective;
  p.order = {"pp", "dp", "tp"};
  CHECK(describe(p) ==
        "pp4 x dp2 x tp8 (sp), zero 1, interleaved (2 chunks) x 8 microbatches, recompute "
        "selective");
  CHECK(p.world_size() == 64);
}

TEST_CASE("an expert parallel degree must divide the data parallel degree and the experts") {
  parallel_plan p;
  p.dp = 4, p.ep = 2;
  model_shape m{};
  m.experts = 8;
  CHECK(validate(p, m, 4).empty());
  CHECK(p.world_size() == 4);  // ep is carved out of dp: no extra ranks
  CHECK(describe(p).starts_with("dp4 (ep2) x pp1 x tp1, zero 0"));
  p.dp = 6, p.ep = 4;
  m.experts = 6;
  CHECK(
      validate(p, m, 6) ==
      std::vector<std::string>{
          "parallel.ep = 4 does not divide parallel.dp = 6 (the expert-parallel groups are carved "
          "out of the data-parallel ranks)",
          "parallel.ep = 4 does not divide experts = 6"});
  p.ep = 0;
  CHECK(validate(p, {}, 0) == std::vector<std::string>{"parallel.ep = 0 must be >= 1"});
}

TEST_CASE("a context-parallel degree joins the world size the grid and the description") {
  parallel_plan p;
  p.dp = 2, p.cp = 2;
  CHECK(p.world_size() == 4);
  CHECK(grid_order(p) == std::vector<std::string>{"dp", "cp", "pp", "tp"});
  CHECK(degree_of(p, "cp") == 2);
  CHECK(describe(p) ==
        "dp2 x cp2 (ulysses) x pp1 x tp1, zero 0, 1f1b x 1 microbatches, recompute none");
  CHECK(validate(p, llama(), 4).empty());
  p.order = {"pp", "dp", "tp", "cp"};
  CHECK(grid_order(p) == p.order);
  CHECK(validate(p, llama(), 4).empty());
  p.order = {"cp", "dp", "pp", "tp"};
  CHECK(validate(p, llama(), 4) ==
        std::vector<std::string>{"parallel.order = [\"cp\", \"dp\", \"pp\", \"tp\"] must name "
                                 "\"cp\" after \"dp\" (the dp x cp group reads data by dp rank, "
                                 "cp fastest)"});
  // Without context parallelism nothing changes in the line.
  CHECK(describe(parallel_plan{}) ==
        "dp1 x pp1 x tp1, zero 0, 1f1b x 1 microbatches, recompute none");
  for (auto m : {cp_mode_kind::ulysses, cp_mode_kind::ring}) CHECK(parse_cp_mode(name(m)) == m);
  CHECK(!parse_cp_mode("megatron"));
}

TEST_CASE("a context-parallel plan names every shape it does not divide and the ring mode") {
  parallel_plan p;
  p.cp = 3;
  // 32 heads, 8 kv heads, seq 2048: none divisible by 3; the world has 2 ranks.
  CHECK(validate(p, llama(), 2) ==
        std::vector<std::string>{
            "parallel.dp x parallel.cp x parallel.tp x parallel.pp = 1 x 3 x 1 x 1 = 3 does not "
            "equal the world size 2",
            "parallel.cp = 3 does not divide seq = 2048 (every rank holds seq / cp tokens of each "
            "sample)",
            "parallel.cp = 3 does not divide heads = 32 (Ulysses gives each rank heads / cp heads)",
            "parallel.cp = 3 neither divides kv_heads = 8 nor is a multiple of it (Ulysses gives "
            "each rank kv_heads / cp kv heads, or one kv head repeated to cp / kv_heads ranks)"});
  // More ranks than kv heads, a multiple of them: kv heads repeated (32 heads, 8 kv heads, cp 16).
  p.cp = 16;
  CHECK(validate(p, llama(), 16).empty());
  p.cp = 2;
  p.cp_mode = cp_mode_kind::ring;
  p.tp = 2;
  CHECK(validate(p, llama(), 4) ==
        std::vector<std::string>{
            "parallel.cp = 2 with parallel.tp = 2: context parallelism runs on unsharded stages "
            "only so far (parallel.tp = 1; Ulysses or ring inside tensor-parallel attention is not "
            "written)"});
  // Inside pipeline stages (cp x pp): accepted.
  p.tp = 1;
  p.pp = 2;
  CHECK(validate(p, llama(), 4).empty());
  p.pp = 1;
  // Ring needs no head condition (cp 4 over 8 kv heads would do for Ulysses too), only two
  // zigzag chunks per rank: seq 2044 = 4 x 511 splits over 4 ranks but not into 8 chunks.
  p.tp = 1;
  p.cp = 4;
  auto ring_model = llama();
  ring_model.seq = 2044;
  CHECK(validate(p, ring_model, 4) ==
        std::vector<std::string>{
            "parallel.cp = 4 with parallel.cp_mode = \"ring\": 2 x cp = 8 does not divide seq = "
            "2044 (every rank holds two zigzag chunks of seq / (2 cp) tokens of each sample)"});
  CHECK(validate(p, llama(), 4).empty());
  p.cp = 2;
  p.order = {"dp", "cp", "cp", "pp", "tp"};
  p.cp_mode = cp_mode_kind::ulysses;
  CHECK(validate(p, llama(), 2) ==
        std::vector<std::string>{"parallel.order = [\"dp\", \"cp\", \"cp\", \"pp\", \"tp\"] must "
                                 "name each of \"dp\", \"pp\" and \"tp\" exactly once (and \"cp\" "
                                 "at most once)"});
}
