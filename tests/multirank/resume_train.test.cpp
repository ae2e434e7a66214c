// Resuming across plans with real processes: a run of `troupe train` saved under one plan (or in
// one process) continues under another plan (or in one process) with checkpoint.resume, and its
// steps 4-6 give the losses of the single process trained 6 steps straight and, at the end, its
// weights, as far as f32 rounding goes (same_losses, same_weights: as accurate as the straight run
// against its f64 twin; the resumed run's error includes its first 3 steps', as the straight's).
// The learning rate is constant after the warmup (min-lr = lr), so a 3-step run and its resumed
// 6-step run follow the straight run's schedule - except in the case where it moves across the
// resume (a 4-step warmup, then the cosine), whose resumed steps must take the 6-step schedule's
// rates. A resume with nothing left to train, or from weights only, fails naming the flag or file,
// on every rank.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/multirank/same_weights.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;

namespace {

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  a.insert(a.end(), {"--lr", "1e-3", "--min-lr", "1e-3"});
  return a;
}

reference_losses tail3(const reference_losses& six) {
  REQUIRE(six.f32.size() == 6);
  return six.steps(3, 6);
}

// A launched run that must fail (within 120 s: no rank may be left waiting): its output.
std::string failing(const std::vector<std::string>& argv) {
  using namespace std::chrono_literals;
  child_process p(argv);
  auto st = p.wait(120s);
  INFO(p.output());
  REQUIRE(st.has_value());
  CHECK(child_process::code(*st) != 0);
  return p.output();
}

}  // namespace

TEST_CASE("A run saved under one plan resumes under another and in one process",
          "[multirank][slow]") {
  auto dir = scratch("resume");
  const std::string straight = dir + "/straight", dp2 = dir + "/dp2", tp2pp2 = dir + "/tp2pp2",
                    one = dir + "/one", dp2pp2 = dir + "/dp2pp2";
  // GPT-2: dp 2 (ZeRO 1) -> tp 2 x pp 2, dp 2 -> one process, one process -> dp 2 x pp 2 (ZeRO 2).
  auto want = single_and_twin("gpt2-demo", 6, dir, with({"--checkpoint-dir", straight}, {}));
  same_losses(launched(2, "gpt2-demo", 3, dir, "dp2",
                       with({"--dp", "2", "--zero", "1"}, {"--checkpoint-dir", dp2})),
              want.steps(0, 3));
  same_losses(launched(4, "gpt2-demo", 6, dir, "tp2pp2",
                       with({"--tp", "2", "--pp", "2", "--microbatches", "2"},
                            {"--resume", dp2, "--checkpoint-dir", tp2pp2})),
              tail3(want));
  same_weights(tp2pp2, straight);
  same_losses(single("gpt2-demo", 6, dir, with({"--resume", dp2}, {})), tail3(want));
  single("gpt2-demo", 3, dir, with({"--checkpoint-dir", one}, {}));
  same_losses(launched(4, "gpt2-demo", 6, dir, "dp2pp2",
                       with({"--dp", "2", "--pp", "2", "--zero", "2", "--microbatches", "2"},
                            {"--resume", one, "--checkpoint-dir", dp2pp2})),
              tail3(want));
  same_weights(dp2pp2, straight);

  // Llama: tp 2 -> dp 2 with ZeRO 3.
  const std::string lstraight = dir + "/lstraight", ltp2 = dir + "/ltp2", ldp2 = dir + "/ldp2";
  auto lwant = single_and_twin("llama-tiny", 6, dir, with({"--checkpoint-dir", lstraight}, {}));
  launched(2, "llama-tiny", 3, dir, "ltp2", with({"--tp", "2"}, {"--checkpoint-dir", ltp2}));
  same_losses(
      launched(2, "llama-tiny", 6, dir, "ldp2",
               with({"--dp", "2", "--zero", "3"}, {"--resume", ltp2, "--checkpoint-dir", ldp2})),
      tail3(lwant));
  same_weights(ldp2, lstraight);
  std::filesystem::remove_all(dir);
}

TEST_CASE("A run saved under tp 2 x pp 2 resumes under dp 2 with ZeRO 2 as the learning rate moves",
          "[multirank][slow]") {
  auto dir = scratch("resume-lr");
  // Warmup over 4 steps, then a cosine to 1e-4 over the last 2: the 3-step run's steps are all
  // in the warmup (which does not depend on --steps), the resumed steps 4-6 take 1e-3, 1e-3 and
  // 5.5e-4 from the 6-step schedule.
  auto lr = [](std::vector<std::string> a) {
    a.insert(a.end(), {"--warmup", "4", "--lr", "1e-3", "--min-lr", "1e-4"});
    return a;
  };
  const std::string straight = dir + "/straight", tp2pp2 = dir + "/tp2pp2", dp2 = dir + "/dp2";
  auto want = single_and_twin("gpt2-demo", 6, dir, lr({"--checkpoint-dir", straight}));
  // GPT-2 under tp 2 x pp 2: wte tied to the head across the stages, qkv fused and split over tp.
  same_losses(
      launched(4, "gpt2-demo", 3, dir, "tp2pp2",
               lr({"--tp", "2", "--pp", "2", "--microbatches", "2", "--checkpoint-dir", tp2pp2})),
      want.steps(0, 3));
  // Nothing left to train: refused naming --steps and the saved step, launched (every rank
  // ending) and in one process.
  auto no_steps_left = [&](const std::string& out) {
    CHECK_THAT(out, Catch::Contains("train.steps (--steps) is 3") &&
                        Catch::Contains(tp2pp2 + "' is at step 3"));
  };
  no_steps_left(
      failing(launch_argv(2, "gpt2-demo", 3, dir, "done", lr({"--dp", "2", "--resume", tp2pp2}))));
  auto one = flags_with("gpt2-demo", 3, lr({"--resume", tp2pp2}));
  one.insert(one.begin(), troupe_bin);
  no_steps_left(failing(one));
  std::string log;
  same_losses(
      launched(2, "gpt2-demo", 6, dir, "dp2",
               lr({"--dp", "2", "--zero", "2", "--resume", tp2pp2, "--checkpoint-dir", dp2}), &log),
      tail3(want));
  same_weights(dp2, straight);
  const auto lrs = json_values(dir + "/dp2.json", "lr");
  const std::vector<double> want_lr = {1e-3, 1e-3, 1e-4 + 0.5 * (1e-3 - 1e-4)};
  REQUIRE(lrs.size() == want_lr.size());
  // Not rounding of the training: the schedule is computed in f64 and --json prints it with 6
  // significant digits, so 1e-5 relative is its printing; a wrong schedule is off by 10% or more.
  for (std::size_t i = 0; i < lrs.size(); ++i) CHECK(lrs[i] == Approx(want_lr[i]).epsilon(1e-5));
  // The progress starts at the resumed step: its first line is step 4's.
  CHECK_THAT(log, Catch::Contains("step     4/6"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("A launched run resuming from a folder of weights only fails naming the file",
          "[multirank]") {
  auto dir = scratch("resume-bad");
  const std::string weights = dir + "/weights";
  single("gpt2-demo", 1, dir, {"--checkpoint-dir", weights});
  std::filesystem::remove(weights + "/optimizer.safetensors");
  const auto out =
      failing(launch_argv(2, "gpt2-demo", 2, dir, "weights", {"--dp", "2", "--resume", weights}));
  CHECK_THAT(out,
             Catch::Contains(weights + "/optimizer.safetensors") && Catch::Contains("--model-hf"));
  std::filesystem::remove_all(dir);
}
