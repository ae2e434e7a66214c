// Activation recompute on Llama tensor shards across processes: `troupe launch -n N -- troupe train
// --tp 2 --sp --recompute` (each tp_llama block runs its forward again before its backward, the
// sequence-parallel gathers and reduce-scatters inside it too) against the single-process `troupe
// train` without recompute: the losses as accurate as its own against its f64 twin (same_losses,
// tests/rounding.hpp). And dp 2 x tp 2 with ZeRO 3,
// where each block is gathered for its backward and the recomputed forward must fall inside it.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;

TEST_CASE("Tensor parallel Llama runs with activation recompute match the single process",
          "[multirank][slow]") {
  const int steps = 4;
  scratch_dir dir("llama-recompute");
  // The reference, run once for both sections (Catch runs this body once per section).
  static reference_losses want;
  if (want.f32.empty()) want = single_and_twin("llama-tiny", steps, dir.path);
  SECTION("tp 2 with sequence parallelism") {
    same_losses(
        launched(2, "llama-tiny", steps, dir.path, "tp2sprc", {"--tp", "2", "--sp", "--recompute"}),
        want);
  }
  SECTION("dp 2 x tp 2 with ZeRO 3") {
    same_losses(launched(4, "llama-tiny", steps, dir.path, "dp2tp2z3rc",
                         {"--dp", "2", "--tp", "2", "--zero", "3", "--recompute"}),
                want);
  }
}
