// hybrid_trainer on threads (ranks of local groups): parallel.recompute full over pipeline stages
// against the single-process trainer without recompute at the same tokens per step; selective
// refused naming the setting; parallel.dp_bucket_bytes and dp_overlap handed to the data-parallel
// engine.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <exception>
#include <memory>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/causal_lm.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/hybrid.hpp"
#include "models/trainer.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;

namespace {

void rows_of(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3) % 251);
}

train_config small_run() {
  train_config c;
  c.batch = 4;
  c.seq = 16;
  c.lr = 1e-2;
  c.warmup = 1;
  c.clip = 0.5;
  c.seed = 3;
  return c;
}

}  // namespace

TEST_CASE("A plan asking for selective recompute is refused naming the setting", "[parallel]") {
  auto model = named_model_config("gpt2-demo").value();
  train_config c = small_run();
  c.plan.recompute = scheduler::recompute_policy::selective;
  auto one = collective::make_local_group(1);
  hybrid_groups g{one[0].get(), one[0].get(), one[0].get(), one[0].get()};
  CHECK_THROWS_WITH(hybrid_trainer(model, c, g), Catch::Contains("parallel.recompute selective"));
}

// pp 2 (1F1B, 4 microbatches of one row) with parallel.recompute full: every step's loss as
// accurate as the single-process trainer's without recompute (the whole model), against the same
// run in f64 (tests/rounding.hpp: the microbatches add the gradient in another order, AdamW
// magnifies that rounding in both f32 runs alike; a step or a microbatch left out is off by O(lr)).
TEST_CASE("Pipeline stages with parallel recompute full train like the single process",
          "[parallel]") {
  const int steps = 3;
  auto model = named_model_config("gpt2-demo").value();
  train_config c = small_run();
  std::vector<double> want, exact;
  for (bool f64 : {false, true}) {
    auto m = make_causal_lm(model, {c.batch, c.seq}, f64 ? dtype::f64 : dtype::f32);
    m->init_weights(c.seed);
    train_config cw = c;
    if (f64) cw.precision = "f64";
    trainer t(*m, cw);
    for (int s = 0; s < steps; ++s) (f64 ? exact : want).push_back(t.step(rows_of).loss);
  }
  c.plan.pp = 2;
  c.plan.microbatches = 4;
  c.plan.recompute = scheduler::recompute_policy::full;
  auto pp = collective::make_local_group(2), mp = collective::make_local_group(2);
  std::vector<std::vector<double>> got(2);
  std::vector<std::string> described(2);
  std::vector<std::exception_ptr> err(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r)
    threads.emplace_back([&, r] {
      try {
        auto one = collective::make_local_group(1), other = collective::make_local_group(1);
        hybrid_groups g{one[0].get(), pp[r].get(), other[0].get(), mp[r].get()};
        hybrid_trainer t(model, c, g);
        described[r] = t.describe();
        for (int s = 0; s < steps; ++s) got[r].push_back(t.step(rows_of).loss);
      } catch (...) {
        err[r] = std::current_exception();
        pp[r]->abort("rank failed");
        mp[r]->abort("rank failed");
        pp[1 - r]->abort("rank failed");
        mp[1 - r]->abort("rank failed");
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r << ": " << described[r]);
    CHECK(described[r].find("recompute") != std::string::npos);
    auto v = tests::as_accurate_as(got[r], want, exact, tests::trajectory_k);
    INFO("losses: " << v.str());
    CHECK(v.ok());
  }
}

// parallel.dp_bucket_bytes and parallel.dp_overlap are the engine's options, and the hybrid
// trainer hands them over: dp 2 with 64 KiB buckets reduced after backward issues no gradient
// reduction over 16384 elements on the dp group (its flight recorder), the default 25 MiB bucket
// holds the whole model in one; both train to the same losses bit for bit (a sum of two
// gradients is the same whichever bucket carries it). A bucket of 0 bytes is refused naming the
// key.
TEST_CASE("The data-parallel bucket and overlap settings reach the engine", "[parallel]") {
  scheduler::parallel_plan p;
  p.dp_bucket_bytes = 65536;
  p.dp_overlap = false;
  const auto o = dp_options::of(p);
  CHECK(o.bucket_bytes == 65536);
  CHECK_FALSE(o.overlap);
  CHECK(dp_options::of(scheduler::parallel_plan{}).bucket_bytes == dp_options{}.bucket_bytes);
  CHECK(dp_options::of(scheduler::parallel_plan{}).overlap);

  const int steps = 2;
  auto model = named_model_config("gpt2-demo").value();
  struct run_result {
    std::vector<double> losses;
    std::size_t widest = 0;  // the most elements of one allreduce on the dp group
  };
  auto run = [&](const train_config& c) {
    auto dp = collective::make_local_group(2);
    std::vector<run_result> out(2);
    std::vector<std::exception_ptr> err(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r)
      threads.emplace_back([&, r] {
        try {
          auto pp = collective::make_local_group(1), tp = collective::make_local_group(1),
               mp = collective::make_local_group(1);
          hybrid_groups g{dp[r].get(), pp[0].get(), tp[0].get(), mp[0].get()};
          hybrid_trainer t(model, c, g);
          for (int s = 0; s < steps; ++s) out[r].losses.push_back(t.step(rows_of).loss);
          for (const auto& rec : dp[r]->recent())
            if (rec.kind == collective::op_kind::allreduce)
              out[r].widest = std::max(out[r].widest, rec.count);
        } catch (...) {
          err[r] = std::current_exception();
          for (auto& d : dp) d->abort("rank failed");
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : err)
      if (e) std::rethrow_exception(e);
    CHECK(out[0].losses == out[1].losses);
    return out[0];
  };
  train_config c = small_run();
  c.plan.dp = 2;
  const auto whole = run(c);
  c.plan.dp_bucket_bytes = 65536;
  c.plan.dp_overlap = false;
  const auto small = run(c);
  CHECK(whole.widest > 16384);
  CHECK(small.widest > 0);
  CHECK(small.widest <= 16384);
  CHECK(small.losses == whole.losses);

  c.plan.dp_bucket_bytes = 0;
  auto one = collective::make_local_group(1);
  hybrid_groups g{one[0].get(), one[0].get(), one[0].get(), one[0].get()};
  c.plan.dp = 1;
  CHECK_THROWS_WITH(hybrid_trainer(model, c, g), Catch::Contains("parallel.dp_bucket_bytes = 0"));
}
