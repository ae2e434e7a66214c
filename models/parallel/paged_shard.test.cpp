// ZeRO 3 with the memory tiers holding the rank's whole shard (dp_options::moments with
// page_shard, paged_shard.hpp): dp ranks as threads of one process (collective/local), each with
// its f32 master parameters, reduced gradients and AdamW moments in tier-manager chunks homed on
// NVMe behind a host pool of a fraction of them, train as the same ranks with the shard in memory
// do - losses, gradient norms, weights and moments bit for bit (the same kernels run on the same
// values in the same order: the collectives read and write the same bytes at other addresses,
// AdamW, the clip scale and the accumulation are elementwise, the norm repeats ops::sum_squares's
// chunking).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <exception>
#include <filesystem>
#include <iostream>
#include <latch>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/mixed_piece.hpp"
#include "models/parallel/model_producer.hpp"
#include "models/parallel/paged_shard.hpp"
#include "models/parallel/paged_testing.hpp"
#include "models/parallel/testing.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
using troupe::models::testing::flat;
using troupe::models::testing::paged_rows;
using troupe::models::testing::paged_run;
using troupe::models::testing::temp_folder;
namespace fs = std::filesystem;

namespace {

struct rank_result {
  std::vector<step_result> steps;
  std::vector<float> params, m, v;
  std::vector<float> mid_params, mid_m;  // after step 2 (off-step uses in the middle of a run)
  memory::tier_report tiers;
  std::int64_t shard_elements = 0;
  std::size_t segments = 0;
};

// dp 2 ranks of a tiny GPT-2 or Llama (bf16: under mixed_piece); moments in tiers when given.
std::vector<rank_result> run(bool llama, const train_config& c,
                             const std::optional<moment_tiers>& tiers, std::size_t bucket_bytes) {
  const int dp = c.plan.dp;
  auto comms = collective::make_local_group(dp);
  std::vector<rank_result> out(dp);
  std::vector<std::exception_ptr> errors(dp);
  std::vector<std::thread> threads;
  const bool bf16 = c.precision == "bf16";
  // A rank that fails aborts the group; its model and trainer live until every rank is out of its
  // step, so a peer's collective never reads freed buffers.
  std::latch out_of_steps(dp);
  for (int r = 0; r < dp; ++r)
    threads.emplace_back([&, r] {
      std::unique_ptr<causal_lm> m;
      std::unique_ptr<model_producer> inner;
      std::unique_ptr<mixed_piece> mixed;
      std::unique_ptr<dp_trainer> trainer;
      try {
        auto cfg = named_model_config(llama ? "llama-tiny" : "gpt2-demo", 29).value();
        m = make_causal_lm(cfg, {dp_trainer::microbatch_rows(c), c.seq},
                           bf16 ? dtype::bf16 : dtype::f32, device::cpu(), {.recompute = true});
        m->init_weights(5);
        inner = std::make_unique<model_producer>(*m);
        if (bf16) mixed = std::make_unique<mixed_piece>(*inner);
        grad_producer& piece = bf16 ? static_cast<grad_producer&>(*mixed) : *inner;
        dp_options o{.bucket_bytes = bucket_bytes};
        if (tiers) {
          o.moments = *tiers;
          o.moments->nvme_dir += "/dp" + std::to_string(r);
        }
        trainer = std::make_unique<dp_trainer>(piece, c, *comms[r], o);
        dp_trainer& t = *trainer;
        auto& res = out[r];
        for (int s = 0; s < c.steps; ++s) {
          res.steps.push_back(t.step(paged_rows));
          if (s != 1) continue;
          // A checkpoint's uses between steps: everything gathered, the moments copied out (and
          // written back by the next step).
          t.gather_full_parameters();
          res.mid_params = flat(piece.memory().params());
          res.mid_m = flat(t.optimizer_state().m);
        }
        t.gather_full_parameters();
        res.params = flat(piece.memory().params());
        const auto st = t.optimizer_state();
        res.m = flat(st.m);
        res.v = flat(st.v);
        if (auto* tm = t.moment_tiers_manager(); tm != nullptr) res.tiers = tm->report();
        for (const auto& b : t.buckets()) res.shard_elements += b.chunk;
      } catch (...) {
        errors[r] = std::current_exception();
        for (auto& comm : comms) comm->abort("rank " + std::to_string(r) + " failed");
      }
      out_of_steps.arrive_and_wait();
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

// The shard homed on NVMe in segments of two buckets' chunks, with a host pool of `slots`
// segments.
moment_tiers on_nvme(const fs::path& dir, std::size_t bucket_bytes, std::size_t slots) {
  moment_tiers t;
  t.home = memory::tier::nvme;
  t.nvme_dir = dir.string();
  t.segment_bytes = bucket_bytes;  // a rank's chunk is bucket_bytes / 2
  t.host_bytes = slots * t.segment_bytes;
  t.prefetch_depth = 4;
  return t;
}

std::size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], 4) != 0;
  return n;
}

void check_same(const std::vector<rank_result>& want, const std::vector<rank_result>& got,
                std::size_t host_bytes) {
  REQUIRE(want.size() == got.size());
  for (std::size_t r = 0; r < want.size(); ++r) {
    INFO("rank " << r);
    for (std::size_t s = 0; s < want[r].steps.size(); ++s) {
      INFO("step " << s + 1);
      CHECK(got[r].steps[s].loss == want[r].steps[s].loss);
      CHECK(got[r].steps[s].grad_norm == want[r].steps[s].grad_norm);
    }
    CHECK(differing(want[r].mid_params, got[r].mid_params) == 0);
    CHECK(differing(want[r].mid_m, got[r].mid_m) == 0);
    CHECK(differing(want[r].params, got[r].params) == 0);
    CHECK(differing(want[r].m, got[r].m) == 0);
    CHECK(differing(want[r].v, got[r].v) == 0);
    // Paged: the four parts of the shard live on NVMe (its pages hold them all), the host holds a
    // fraction of them, every step wrote and read the file, and from the second step on the
    // recorded schedule prefetched.
    const auto& t = got[r].tiers;
    const std::uint64_t state = 4 * 4 * static_cast<std::uint64_t>(got[r].shard_elements);
    CHECK(t.nvme_bytes >= state);
    CHECK(t.host_used <= host_bytes);
    CHECK(host_bytes * 3 < state);
    CHECK(t.nvme_write_bytes > state);
    CHECK(t.nvme_read_bytes > state);
    CHECK(t.evictions > 0);
    CHECK(t.prefetches > 0);
    CHECK(t.hits > 0);
  }
  CHECK(want[0].steps.front().grad_norm > 0.5);  // clipping acted
}

}  // namespace

TEST_CASE("ZeRO 3 with its whole shard paged to NVMe trains as with the shard in memory",
          "[offload]") {
  temp_folder dir("paged_shard", "zero3");
  // 64 KiB buckets (32 KiB chunks per rank), segments of two chunks, a host pool of 20 segments:
  // about a quarter of the shard's state. Gradient accumulation: train.grad_accum 2 and two
  // microbatches per rank (the second reduction of each bucket goes through the staging ring and
  // is added into the paged gradients).
  const auto with_accumulation = [](train_config c) {
    c.plan.microbatches = 2;  // two per rank: the second reduction of a bucket is added
    return c;
  };
  const std::size_t bucket = 64 << 10, slots = 20;
  SECTION("gpt2, f32") {
    const auto c = with_accumulation(paged_run(3, false));
    check_same(run(false, c, std::nullopt, bucket),
               run(false, c, on_nvme(dir.path, bucket, slots), bucket), slots * bucket);
  }
  SECTION("llama, bf16 with f32 master weights") {
    const auto c = with_accumulation(paged_run(3, true));
    check_same(run(true, c, std::nullopt, bucket),
               run(true, c, on_nvme(dir.path, bucket, slots), bucket), slots * bucket);
  }
}

TEST_CASE("a paged ZeRO 3 shard whose host pool cannot hold one update is refused naming the flag",
          "[offload][faults]") {
  temp_folder dir("paged_shard", "small");
  const auto c = paged_run(3, false);
  try {
    run(false, c, on_nvme(dir.path, 64 << 10, 3), 64 << 10);
    FAIL("a host pool of 3 segments was accepted");
  } catch (const error& e) {
    std::cout << "faults: ZeRO 3 shard paged through 3 host segments -> refused: " << e.what()
              << "\n";
    CHECK_THAT(e.what(), Catch::Contains("--host-memory"));
  }
}

TEST_CASE(
    "a paged ZeRO 3 shard whose host pool cannot hold a block's gathers is refused naming "
    "the flag",
    "[offload][faults]") {
  // Five segments hold the update's four, but a block's parameter gathers pin six (twelve 64 KiB
  // buckets): both ranks fail at the same acquire of the first step, before its collective.
  temp_folder dir("paged_shard", "gathers");
  const auto c = paged_run(3, false);
  try {
    run(false, c, on_nvme(dir.path, 64 << 10, 5), 64 << 10);
    FAIL("a host pool of 5 segments was accepted");
  } catch (const error& e) {
    std::cout << "faults: ZeRO 3 shard paged through 5 host segments -> refused: " << e.what()
              << "\n";
    CHECK_THAT(e.what(), Catch::Contains("--host-memory"));
    CHECK_THAT(e.what(), Catch::Contains("--dp-bucket-bytes"));
  }
}
