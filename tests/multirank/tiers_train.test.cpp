// Memory tiers from the command line in bf16 and under ZeRO on several launched ranks: each run
// equals its run without tiers bit for bit - the per-step losses and the checkpoint's files
// (weights and AdamW's moments), since the tiers only move bytes between memories and the same
// kernels run in the same order on the same values. Under ZeRO 3 the tiers hold each rank's whole
// shard: its f32 master parameters, reduced gradients and moments (paged_shard.hpp).
#include <catch2/catch.hpp>

#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "tests/multirank/train_runs.hpp"

using namespace troupe::tests;

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  REQUIRE(f.good());
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// The two checkpoints hold the same weights and moments, byte for byte.
void same_checkpoint_files(const std::string& got, const std::string& want) {
  for (const char* f : {"model.safetensors", "optimizer.safetensors"}) {
    INFO(f << " of " << got << " against " << want);
    const std::string a = file_bytes(got + "/" + f), b = file_bytes(want + "/" + f);
    const bool same = a == b;  // (not CHECK(a == b): Catch would print megabytes)
    CHECK(same);
  }
}

std::vector<std::string> with(std::vector<std::string> a, const std::vector<std::string>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

TEST_CASE("bf16 with memory tiers trains as the plain bf16 run, GPT-2 and Llama",
          "[multirank][offload]") {
  scratch_dir dir("tiers-bf16");
  const int steps = 4;
  for (const std::string model : {"gpt2-demo", "llama-tiny"}) {
    INFO(model);
    const std::vector<std::string> bf16 = {"--precision", "bf16", "--grad-accum", "2",
                                           "--recompute"};
    const std::string plain_ck = dir.path + "/" + model + "-plain",
                      tiers_ck = dir.path + "/" + model + "-tiers";
    const auto want =
        single(model, steps, dir.path, with(bf16, {"--checkpoint-dir", plain_ck}), model + "-p");
    // Automatic placement: the first step measures the non-model memory, then the chunks move.
    const auto got = single(
        model, steps, dir.path,
        with(bf16, {"--checkpoint-dir", tiers_ck, "--device-memory", "24M", "--offload", "auto"}),
        model + "-t");
    REQUIRE(got.size() == static_cast<std::size_t>(steps));
    CHECK(got == want);
    same_checkpoint_files(tiers_ck, plain_ck);
  }
}

TEST_CASE("ZeRO 3 on two launched ranks with memory tiers trains as without them",
          "[multirank][offload]") {
  scratch_dir dir("tiers-zero3");
  const int steps = 4;
  const std::vector<std::string> zero3 = {"--dp", "2", "--zero", "3"};
  // The shard (parameters, gradients, moments: about 6.6 MiB per rank) homed on NVMe, a host pool
  // of five 1 MiB slots: every step pages it.
  const std::vector<std::string> tiers = {
      "--device-memory", "64M",  "--host-memory", "5M",
      "--offload",       "auto", "--nvme-dir",    dir.path + "/nvme"};
  const std::string plain_ck = dir.path + "/plain", tiers_ck = dir.path + "/tiers";
  const auto want = launched(2, "gpt2-demo", steps, dir.path, "zero3",
                             with(zero3, {"--checkpoint-dir", plain_ck}));
  std::string out;
  const auto got = launched(2, "gpt2-demo", steps, dir.path, "zero3-tiers",
                            with(with(zero3, tiers), {"--checkpoint-dir", tiers_ck}), &out);
  INFO(out);
  REQUIRE(got.size() == static_cast<std::size_t>(steps));
  CHECK(got == want);
  same_checkpoint_files(tiers_ck, plain_ck);
  CHECK(out.find("shard (parameters, gradients, optimizer state) in memory tiers (nvme") !=
        std::string::npos);
  CHECK(out.find("ZeRO 3 shard in tiers") != std::string::npos);
  CHECK(out.find("NVMe read") != std::string::npos);

  // The plain run's checkpoint continued two steps with and without tiers: the moments are
  // scattered into the paged state and go on bit for bit.
  const std::vector<std::string> more = {"--resume", plain_ck, "--steps", "6"};
  const auto a = launched(2, "gpt2-demo", steps, dir.path, "resume-plain", with(zero3, more));
  const auto b =
      launched(2, "gpt2-demo", steps, dir.path, "resume-tiers", with(with(zero3, tiers), more));
  REQUIRE(a.size() == 2);
  CHECK(a == b);
}

TEST_CASE("ZeRO 3 in bf16 on two launched ranks with memory tiers trains as without them",
          "[multirank][offload]") {
  scratch_dir dir("tiers-zero3-bf16");
  const int steps = 4;
  const std::vector<std::string> plan = {
      "--dp", "2", "--zero", "3", "--precision", "bf16", "--grad-accum", "2", "--recompute"};
  const std::string plain_ck = dir.path + "/plain", tiers_ck = dir.path + "/tiers";
  const auto want = launched(2, "llama-tiny", steps, dir.path, "bf16",
                             with(plan, {"--checkpoint-dir", plain_ck}));
  const auto got = launched(2, "llama-tiny", steps, dir.path, "bf16-tiers",
                            with(plan, {"--checkpoint-dir", tiers_ck, "--device-memory", "64M",
                                        "--host-memory", "5M", "--nvme-dir", dir.path + "/nvme"}));
  REQUIRE(got.size() == static_cast<std::size_t>(steps));
  CHECK(got == want);
  same_checkpoint_files(tiers_ck, plain_ck);
}
