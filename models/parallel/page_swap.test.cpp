// page_swap: two ranges exchange their bytes by swapping pages (mapped ones and the whole pages
// inside a malloc'd buffer, as a stage's activation arena), and a pipeline stage whose
// activations span whole pages stashes them that way and still gives the single process's loss
// and gradients.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/gpt.hpp"
#include "models/parallel/gpt_stage.hpp"
#include "models/parallel/page_swap.hpp"
#include "models/parallel/pipeline_runner.hpp"
#include "models/parallel/testing.hpp"
#include "models/targets.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;

TEST_CASE("Swapping pages exchanges the bytes of two ranges without copying", "[parallel]") {
  const std::size_t pg = page_size(), n = 8 * pg;
  // a: whole pages inside a malloc'd buffer; b: a mapping of its own.
  std::unique_ptr<std::uint8_t, decltype(&std::free)> heap(
      static_cast<std::uint8_t*>(std::aligned_alloc(pg, n + 2 * pg)), &std::free);
  REQUIRE(heap != nullptr);
  std::uint8_t* a = heap.get() + pg;
  mapped_pages b(n), tmp(n);
  auto* bp = static_cast<std::uint8_t*>(b.data());
  for (std::size_t i = 0; i < n + 2 * pg; ++i) heap.get()[i] = static_cast<std::uint8_t>(i % 251);
  for (std::size_t i = 0; i < n; ++i) bp[i] = static_cast<std::uint8_t>(i % 13 + 7);
  if (!swap_pages(a, bp, tmp.data(), n)) {
    WARN("troupe-skip: the kernel (or valgrind) refuses MREMAP_DONTUNMAP; stages copy instead");
    return;
  }
  for (std::size_t i = 0; i < n; ++i) {
    REQUIRE(a[i] == static_cast<std::uint8_t>(i % 13 + 7));
    REQUIRE(bp[i] == static_cast<std::uint8_t>((i + pg) % 251));
  }
  // The bytes around the swapped pages stay, and both ranges stay writable.
  for (std::size_t i = 0; i < pg; ++i) {
    CHECK(heap.get()[i] == static_cast<std::uint8_t>(i % 251));
    CHECK(heap.get()[n + pg + i] == static_cast<std::uint8_t>((n + pg + i) % 251));
  }
  a[0] = 1;
  bp[n - 1] = 2;
  CHECK(swap_pages(a, bp, tmp.data(), n));
  CHECK(a[n - 1] == 2);
  CHECK(bp[0] == 1);
}

TEST_CASE("A pipeline stage that stashes by swapping pages matches the single process",
          "[parallel]") {
  // gpt2-demo's shape, one row of 128 tokens: each stage's activations are 2.4 MB.
  const gpt_config cfg = testing::gpt_shape(256, 128, 128, 4, 4);
  const batch_dims dims{1, 128};
  const int m = 4;
  std::vector<owned_tensor> ids, targets;
  for (int k = 0; k < m; ++k) {
    ids.push_back(empty({1, 128}, dtype::i32));
    targets.push_back(empty({1, 128}, dtype::i32));
    for (std::int64_t i = 0; i < 128; ++i)
      ids[k].data_as<std::int32_t>()[i] = static_cast<std::int32_t>((i * 37 + k * 11) % 256);
    next_token_targets(ids[k], targets[k]);
  }
  // The single process and its f64 twin (the exact step, tests/rounding.hpp).
  gpt full(cfg, dims);
  full.init_weights(3);
  auto exact = testing::f64_twin(full, dims);
  auto reference = [&](gpt& model) {
    model.memory().zero_grads();
    double loss = 0;
    for (int k = 0; k < m; ++k) {
      loss += model.forward(ids[k], targets[k]) / m;
      model.backward(1.0 / m);
    }
    return loss;
  };
  const double want = reference(full), exact_loss = reference(*exact);
  for (auto kind : {scheduler::schedule_kind::gpipe, scheduler::schedule_kind::one_f_one_b}) {
    scheduler::parallel_plan plan;
    plan.pp = 2;
    plan.schedule = kind;
    plan.microbatches = m;
    auto comms = collective::make_local_group(2);
    std::vector<std::unique_ptr<gpt_stage>> stages(2);
    std::vector<double> loss(2);
    std::vector<std::thread> threads;
    for (int s = 0; s < 2; ++s)
      threads.emplace_back([&, s] {
        stages[s] = std::make_unique<gpt_stage>(cfg, dims, stage_options::of(plan, s));
        stages[s]->init_weights(3);
        pipeline_runner run(*stages[s], *comms[s], plan);
        for (int step = 0; step < 2; ++step) {  // the second step reuses the swapped pages
          stages[s]->memory().zero_grads();
          loss[s] = run.forward_backward(m, [&](int k) {
            return microbatch_data{ids[k], targets[k], 1.0 / m};
          });
        }
      });
    for (auto& t : threads) t.join();
    INFO(scheduler::name(kind));
    CHECK(stages[0]->page_swaps() > 0);  // stage 0 keeps microbatches aside in both schedules
    // Loss and gradients as accurate as the single process's against its f64 twin (the stages
    // run the same f32 operations but for the tied gradient's and the loss's summation order).
    gpt got(cfg, {1, 1});
    got.memory().zero_grads();
    for (int s = 0; s < 2; ++s) {
      auto v = tests::as_accurate_as(std::vector<double>{loss[s]}, std::vector<double>{want},
                                     std::vector<double>{exact_loss});
      INFO("stage " << s << " loss: " << v.str());
      CHECK(v.ok());
      stages[s]->store_to(got.slots(), true, true);
    }
    const auto vg = testing::worst_by_name(got.slots(), full.slots(), exact->slots());
    INFO("worst gradient " << vg.name << ": " << vg.v.str());
    CHECK(vg.v.ok());
  }
}
