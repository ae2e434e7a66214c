// expert_load_values: what an expert-group actor shows of one step's load.
#include "actors/expert_group.hpp"

#include "actors/introspection/render.hpp"

#include <catch2/catch.hpp>

#include <cstdio>

using namespace troupe::actors;

TEST_CASE("An expert group shows its own experts' tokens and the step's imbalance") {
  expert_load_report r;
  r.step = 3;
  r.dp = 3, r.ep = 1, r.edp = 1;
  r.first_expert = 2;
  r.tokens = {500, 400, 700, 448};  // the job's choices of experts 0-3
  r.served = {350, 224};            // this group's experts 2 and 3
  r.imbalance = 700.0 / 512.0;
  r.all_to_all_s = 0.25;
  r.compute_s = 1.0;
  const auto v = expert_load_values(r);
  CHECK(v.at("experts.first") == 2);
  CHECK(v.at("experts.count") == 2);
  CHECK(v.at("tokens.expert2") == 700);
  CHECK(v.at("tokens.expert3") == 448);
  CHECK(v.count("tokens.expert0") == 0);  // another group's expert
  CHECK(v.at("served.expert2") == 350);
  CHECK(v.at("served.expert3") == 224);
  CHECK(v.at("tokens.group") == 1148);
  CHECK(v.at("imbalance") == Approx(1.3671875));
  CHECK(v.at("all_to_all_share") == Approx(0.25));
  CHECK(v.at("dropped") == 0);
}

TEST_CASE("A load report naming experts beyond the model's is refused naming them", "[faults]") {
  expert_load_report r;
  r.step = 1;
  r.first_expert = 3;
  r.tokens = {1, 2, 3, 4};
  r.served = {4, 5};  // experts 3-4 of a model of 4
  try {
    expert_load_values(r);
    FAIL("the report was taken");
  } catch (const std::exception& e) {
    CHECK_THAT(e.what(), Catch::Contains("experts 3-4") && Catch::Contains("4 experts"));
    std::printf("faults: an expert load report for experts 3-4 of 4 -> refused: %s\n", e.what());
  }
}

TEST_CASE("An expert group's load reaches the Prometheus text and the JSON of the snapshot") {
  expert_load_report r;
  r.step = 2;
  r.first_expert = 0;
  r.tokens = {600, 424, 512, 512};
  r.served = {600, 424};
  r.imbalance = 600.0 / 512.0;
  actor_state a;
  a.name = "expert-group@0";
  a.role = "expert-group";
  a.rank = 0;
  a.metrics = expert_load_values(r);
  job_snapshot s;
  s.job = "ep";
  s.world_size = 1;
  s.actors.push_back(a);
  const std::string prom = to_prometheus(s);
  CHECK_THAT(prom, Catch::Contains("troupe_actor_metric{actor=\"expert-group@0\",role=\"expert-"
                                   "group\",rank=\"0\",metric=\"tokens.expert0\"} 600"));
  CHECK_THAT(prom, Catch::Contains("metric=\"imbalance\"} 1.171875"));
  auto back = snapshot_from_json(to_json(s), "test");
  REQUIRE(back.has_value());
  CHECK(back->actors.at(0).metrics.at("served.expert1") == 424);
}
