// `troupe launch ... -- troupe train --pp 2` for an MoE model (mixtral-tiny: 4 experts top-2, its
// router aux loss in the loss, coefficient 0.01) across real processes: pipeline stages
// (models/parallel/moe_stage.hpp: the layers' router statistics travel with the activations, so
// the aux loss is the whole model's), dp2 x pp2, dp2 x ep2 x pp2 (each stage's experts split over
// its two dp ranks, rows exchanged by all-to-all over UCX) and dp4 x ep2 x pp2 (8 processes, each
// expert on two dp ranks of its stage, its gradient reduced over them), each against the
// single-process `troupe train` at the same tokens per step: losses per step (train_runs.hpp's
// same_losses) and the final weights of the checkpoints both write (same_weights.hpp), each as
// accurate as the f32 single process against its f64 twin. The aux loss is per micro-batch over its
// rows, so the single process runs --batch 2 --grad-accum 4 and each plan's dp x microbatches slots
// are 2 rows: slot k is the single process's micro-batch k (scheduler/microbatch.hpp).
#include <catch2/catch.hpp>

#include <string>
#include <tuple>
#include <vector>

#include "tests/multirank/same_weights.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;

namespace {

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("Launched pp2, dp2 x pp2 and dp2 x ep2 x pp2 runs train an MoE model like one process",
          "[multirank]") {
  const int steps = 6;
  const std::string model = "mixtral-tiny";
  scratch_dir dir("epp");
  const std::vector<std::string> rows = {"--batch", "2", "--grad-accum", "4"};
  const std::string ref_ck = dir.path + "/single";
  const reference_losses want =
      single_and_twin(model, steps, dir.path, with(rows, {"--checkpoint-dir", ref_ck}));
  for (const auto& [ranks, name, plan, shows] :
       std::vector<std::tuple<int, std::string, std::vector<std::string>, std::string>>{
           {2, "pp2", {"--pp", "2", "--microbatches", "4"}, "rank 1: dp 0 pp 1 tp 0, stage 1 of 2"},
           {4,
            "dp2pp2",
            {"--dp", "2", "--pp", "2", "--microbatches", "2"},
            "rank 3: dp 1 pp 1 tp 0, stage 1 of 2"},
           {4,
            "dp2ep2pp2",
            {"--dp", "2", "--ep", "2", "--pp", "2", "--microbatches", "2"},
            "experts 2-3 of 4 of every MoE layer (ep 1 of 2, expert data parallel 0 of 1)"},
           // Two ep groups per stage: each expert on two dp ranks, reduced over them.
           {8,
            "dp4ep2pp2",
            {"--dp", "4", "--ep", "2", "--pp", "2", "--microbatches", "1"},
            "experts 0-1 of 4 of every MoE layer (ep 0 of 2, expert data parallel 1 of 2)"}}) {
    INFO(name);
    const std::string ck = dir.path + "/" + name;
    std::string out;
    const auto got = launched(ranks, model, steps, dir.path, name,
                              with(with(plan, rows), {"--checkpoint-dir", ck}), &out);
    CHECK_THAT(out, Catch::Contains(shows));
    same_losses(got, want);
    same_weights(ck, ref_ck);
  }
}
