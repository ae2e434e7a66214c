// The memory tiers under ZeRO on several ranks (dp_options::moments, paged_moments.hpp): dp ranks
// as threads of one process (collective/local), each holding its ZeRO shard's AdamW moments in a
// tier manager's chunks homed on NVMe with a host pool of a few segments, train as the same ranks
// with the moments in memory do - losses, gradient norms, weights and moments bit for bit (the
// update is elementwise, so cutting its runs at segment edges changes no bit; every other step of
// the engine runs unchanged).
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/mixed_piece.hpp"
#include "models/parallel/model_producer.hpp"
#include "models/parallel/paged_moments.hpp"
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
  memory::tier_report tiers;
};

// dp 2 ranks of a tiny GPT-2 or Llama (bf16: under mixed_piece); moments in tiers when given.
std::vector<rank_result> run(bool llama, const train_config& c,
                             const std::optional<moment_tiers>& tiers) {
  const int dp = c.plan.dp;
  auto comms = collective::make_local_group(dp);
  std::vector<rank_result> out(dp);
  std::vector<std::exception_ptr> errors(dp);
  std::vector<std::thread> threads;
  const bool bf16 = c.precision == "bf16";
  for (int r = 0; r < dp; ++r)
    threads.emplace_back([&, r] {
      try {
        auto cfg = named_model_config(llama ? "llama-tiny" : "gpt2-demo", 29).value();
        auto m =
            make_causal_lm(cfg, {dp_trainer::microbatch_rows(c), c.seq},
                           bf16 ? dtype::bf16 : dtype::f32, device::cpu(), {.recompute = true});
        m->init_weights(5);
        model_producer inner(*m);
        std::unique_ptr<mixed_piece> mixed;
        if (bf16) mixed = std::make_unique<mixed_piece>(inner);
        grad_producer& piece = bf16 ? static_cast<grad_producer&>(*mixed) : inner;
        dp_options o{.bucket_bytes = 4 * 10007};
        if (tiers) {
          o.moments = *tiers;
          o.page_shard = false;  // only the moments (paged_shard.test.cpp: the whole ZeRO 3 shard)
          o.moments->nvme_dir += "/dp" + std::to_string(r);
        }
        dp_trainer t(piece, c, *comms[r], o);
        auto& res = out[r];
        for (int s = 0; s < c.steps; ++s) res.steps.push_back(t.step(paged_rows));
        t.gather_full_parameters();
        res.params = flat(piece.memory().params());
        const auto st = t.optimizer_state();
        res.m = flat(st.m);
        res.v = flat(st.v);
        if (auto* tm = t.moment_tiers_manager(); tm != nullptr) res.tiers = tm->report();
      } catch (...) {
        errors[r] = std::current_exception();
        for (auto& comm : comms) comm->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

// Moments homed on NVMe in small segments, with a host pool of four segments: every update reads
// every segment back from the file and writes it out again.
moment_tiers on_nvme(const fs::path& dir) {
  moment_tiers t;
  t.home = memory::tier::nvme;
  t.nvme_dir = dir.string();
  t.segment_bytes = 16 << 10;
  t.host_bytes = 4 * t.segment_bytes;
  t.prefetch_depth = 2;
  return t;
}

std::size_t differing(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  std::size_t n = 0;
  for (std::size_t i = 0; i < a.size(); ++i) n += std::memcmp(&a[i], &b[i], 4) != 0;
  return n;
}

void check_same(const std::vector<rank_result>& want, const std::vector<rank_result>& got) {
  REQUIRE(want.size() == got.size());
  for (std::size_t r = 0; r < want.size(); ++r) {
    INFO("rank " << r);
    for (std::size_t s = 0; s < want[r].steps.size(); ++s) {
      INFO("step " << s + 1);
      CHECK(got[r].steps[s].loss == want[r].steps[s].loss);
      CHECK(got[r].steps[s].grad_norm == want[r].steps[s].grad_norm);
    }
    // Bit for bit: the same kernels on the same values in the same order; only the moments'
    // bytes moved between the NVMe file and the host pool.
    CHECK(differing(want[r].params, got[r].params) == 0);
    CHECK(differing(want[r].m, got[r].m) == 0);
    CHECK(differing(want[r].v, got[r].v) == 0);
    // The moments were paged: written to NVMe, evicted, read back.
    CHECK(got[r].tiers.nvme_write_bytes > 0);
    CHECK(got[r].tiers.nvme_read_bytes > 0);
    CHECK(got[r].tiers.evictions > 0);
  }
  CHECK(want[0].steps.front().grad_norm > 0.5);  // clipping acted
}

}  // namespace

TEST_CASE("ZeRO 3 on two ranks with its moments paged to NVMe trains as without tiers",
          "[offload]") {
  temp_folder dir("paged_moments", "zero3");
  SECTION("gpt2, f32") {
    const auto c = paged_run(3, false);
    check_same(run(false, c, std::nullopt), run(false, c, on_nvme(dir.path)));
  }
  SECTION("llama, bf16 with f32 master weights") {
    const auto c = paged_run(3, true);
    check_same(run(true, c, std::nullopt), run(true, c, on_nvme(dir.path)));
  }
}

TEST_CASE("ZeRO 1 and 2 page their moments as ZeRO 3 does", "[offload]") {
  temp_folder dir("paged_moments", "zero12");
  for (int zero : {1, 2}) {
    INFO("zero " << zero);
    const auto c = paged_run(zero, false);
    check_same(run(false, c, std::nullopt), run(false, c, on_nvme(dir.path)));
  }
}

TEST_CASE("the paged moments resume from a copy written into optimizer_state", "[offload]") {
  // A resume writes the moments into optimizer_state()'s views; the next update must use them.
  temp_folder dir("paged_moments", "resume");
  moment_tiers t = on_nvme(dir.path);
  paged_moments pm(10000, t);
  owned_tensor m = zeros({10000}), v = zeros({10000});
  for (std::int64_t i = 0; i < 10000; ++i) {
    m.data_as<float>()[i] = static_cast<float>(i);
    v.data_as<float>()[i] = static_cast<float>(2 * i);
  }
  pm.copy_in(m, v);
  owned_tensor m2 = zeros({10000}), v2 = zeros({10000});
  pm.copy_out(m2, v2);
  CHECK(std::memcmp(m.data(), m2.data(), 40000) == 0);
  CHECK(std::memcmp(v.data(), v2.data(), 40000) == 0);
  CHECK(pm.segments() == 3);  // 16 KiB segments of 4096 elements
  CHECK(pm.tiers().report().nvme_write_bytes > 0);
}

TEST_CASE("moments in tiers without a ZeRO shard are refused naming the setting",
          "[offload][faults]") {
  train_config c = paged_run(0, false);
  c.plan.dp = 1;
  auto comms = collective::make_local_group(1);
  auto m = make_causal_lm(named_model_config("gpt2-demo", 29).value(), {4, 8});
  dp_options o;
  o.moments = moment_tiers{};
  try {
    dp_trainer t(*m, c, *comms[0], o);
    FAIL("zero 0 with paged moments was accepted");
  } catch (const error& e) {
    std::cout << "faults: dp_trainer with moments in tiers and zero 0 -> refused: " << e.what()
              << "\n";
    CHECK_THAT(e.what(), Catch::Contains("parallel.zero"));
  }
}
