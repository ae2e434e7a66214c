// Data parallelism (ZeRO 0, 1, 2) against the single-process trainer: dp ranks as threads of one
// process (collective/local), each with its own copy of a tiny GPT-2 or Llama, must reproduce the
// single-process losses and weights at the same global batch.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/exact_run.hpp"
#include "models/parallel/gpt_stage.hpp"
#include "models/parallel/pipeline_runner.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"

using namespace troupe;
using namespace troupe::models;
using troupe::models::parallel::dp_bucket;
using troupe::models::parallel::dp_options;
using troupe::models::parallel::dp_trainer;
using troupe::models::testing::check_as_accurate;
using troupe::models::testing::check_run_as_accurate;
using troupe::models::testing::exact_run;
using troupe::models::testing::exact_training;

namespace {

// Rows of `seq` tokens from a fixed pseudo-random stream, a pure function of the draw.
void synthetic_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3 + (i * draw) % 5) % 29);
}

train_config tiny_run(std::int64_t batch, std::int64_t accum) {
  train_config c;
  c.steps = 10;
  c.batch = batch;
  c.seq = 8;
  c.grad_accum = accum;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.5;  // the first steps' norms exceed it, so clipping is exercised
  // AdamW divides by sqrt(v) + eps: with eps 1e-8 a gradient that is zero in exact arithmetic
  // but rounding noise in f32 (GPT-2's key bias) moves its weight by up to ~lr, differently in
  // every f32 run, which makes the weights' errors heavy-tailed; 1e-6 keeps that noise small
  // while a lost gradient, moment or step still moves weights by ~lr (exact_run.hpp).
  c.eps = 1e-6;
  return c;
}

hf::model_config tiny_model(bool llama) {
  return named_model_config(llama ? "llama-tiny" : "gpt2-demo", 29).value();
}

struct run_result {
  std::vector<step_result> steps;
  std::vector<float> params;
  bool overlapped = false;
  std::int64_t early = 0;  // buckets issued during the last step's backward
};

std::vector<float> host_params(causal_lm& m) {
  auto p = to_device(m.memory().params(), device::cpu());
  return {p.data_as<float>(), p.data_as<float>() + p.numel()};
}

run_result single_process(bool llama, const train_config& c) {
  auto m = make_causal_lm(tiny_model(llama), {c.batch, c.seq});
  m->init_weights(5);
  trainer t(*m, c);
  run_result r;
  for (int s = 0; s < c.steps; ++s) r.steps.push_back(t.step(synthetic_rows));
  r.params = host_params(*m);
  return r;
}

// The same run in f64 from the same weights (models/parallel/exact_run.hpp).
exact_run exact_process(bool llama, const train_config& c) {
  auto m = make_causal_lm(tiny_model(llama), {c.batch, c.seq}, dtype::f64);
  m->init_weights(5);  // the f32 run's weights exactly
  return exact_training(*m, c, synthetic_rows);
}

// Every rank's result; each rank runs in its own thread.
std::vector<run_result> data_parallel(bool llama, train_config c, int dp, int zero,
                                      const dp_options& opts) {
  c.plan.dp = dp;
  c.plan.zero = zero;
  auto comms = collective::make_local_group(dp);
  std::vector<run_result> out(dp);
  std::vector<std::exception_ptr> errors(dp);
  std::vector<std::thread> threads;
  for (int r = 0; r < dp; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto m = make_causal_lm(tiny_model(llama), {dp_trainer::microbatch_rows(c), c.seq});
        m->init_weights(5);
        dp_trainer t(*m, c, *comms[r], opts);
        out[r].overlapped = t.overlapped();
        for (int s = 0; s < c.steps; ++s) out[r].steps.push_back(t.step(synthetic_rows));
        out[r].early = t.buckets_issued_in_backward();
        out[r].params = host_params(*m);
      } catch (...) {
        errors[r] = std::current_exception();
        for (auto& comm : comms) comm->abort("rank " + std::to_string(r) + " failed");
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
  return out;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  double d = 0;
  for (std::size_t i = 0; i < a.size(); ++i)
    d = std::max(d, std::abs(static_cast<double>(a[i]) - b[i]));
  return d;
}

}  // namespace

TEST_CASE("Buckets cover the flat buffer from its end with chunks padded to the group size",
          "[parallel]") {
  auto bs = models::parallel::make_buckets(103, 4, 10);  // chunk 3: buckets of 12, the last of 7
  REQUIRE(bs.size() == 9);
  std::int64_t end = 103, shard = 0;
  for (const auto& b : bs) {
    CHECK(b.begin + b.length == end);
    CHECK(b.chunk == (b.length + 3) / 4);
    CHECK(b.shard_offset == shard);
    end = b.begin;
    shard += b.chunk;
  }
  CHECK(end == 0);
  CHECK(bs.back().length == 7);
  CHECK(bs.back().padded(4));
  CHECK_FALSE(bs.front().padded(4));
}

TEST_CASE("Data parallel training with ZeRO 0 1 and 2 equals the single process trainer",
          "[parallel]") {
  // Small odd-sized buckets: many buckets, one of them padded, so every path runs.
  dp_options opts{.bucket_bytes = 4 * 10007};
  struct shape_case {
    std::int64_t batch, accum;
    int dp, microbatches;
  };
  // dp 2 and 4 over a global batch of 4; 6 samples (3 draws of 2 rows) over 2 ranks (a rank's
  // rows straddle two draws) and over 2 ranks x 3 microbatches. (train_config rejects slots of
  // unequal size.)
  const shape_case shapes[] = {{4, 1, 2, 1}, {4, 1, 4, 1}, {2, 3, 2, 1}, {2, 3, 2, 3}};
  for (bool llama : {false, true}) {
    for (const auto& sc : shapes) {
      train_config c = tiny_run(sc.batch, sc.accum);
      c.plan.microbatches = sc.microbatches;
      auto ref = single_process(llama, c);
      const auto exact = exact_process(llama, c);
      std::vector<float> zero0;
      for (int zero : {0, 1, 2}) {
        INFO((llama ? "llama" : "gpt2")
             << " batch " << sc.batch << " x " << sc.accum << " dp " << sc.dp << " microbatches "
             << sc.microbatches << " zero " << zero);
        auto runs = data_parallel(llama, c, sc.dp, zero, opts);
        for (int s = 0; s < c.steps; ++s) {
          const auto& want = ref.steps[s];
          for (const auto& run : runs) {
            const auto& got = run.steps[s];
            CHECK(got.lr == want.lr);
            CHECK(got.tokens == want.tokens);
          }
        }
        CHECK(ref.steps[0].grad_norm > c.clip);
        // Every rank holds the same weights (bit for bit: the all_gather/allreduce results are
        // the same bytes everywhere) ...
        for (const auto& run : runs) CHECK(run.params == runs[0].params);
        // ... ZeRO 1 updates each element as ZeRO 0 does, from the same allreduced gradients, so
        // its weights are ZeRO 0's bit for bit; ZeRO 2's gradients are reduce-scattered (another
        // summation order) and its norm summed by shards ...
        if (zero == 0) zero0 = runs[0].params;
        if (zero == 1) CHECK(runs[0].params == zero0);
        // ... and all are the single process's losses, norms and weights up to f32 summation
        // order, which Adam magnifies: as accurate as the single process itself against the
        // exact run (exact_run.hpp; the 2e-4 = lr / 15 fitted here held on one CPU only).
        for (const auto& run : runs) check_run_as_accurate(run, ref, exact);
      }
    }
  }
}

TEST_CASE("Buckets issued during backward give the weights of buckets issued after it",
          "[parallel]") {
  for (bool llama : {false, true}) {
    train_config c = tiny_run(4, 1);
    c.steps = 4;
    for (int zero : {0, 2}) {
      INFO((llama ? "llama" : "gpt2") << " zero " << zero);
      auto early = data_parallel(llama, c, 2, zero, {.bucket_bytes = 4 * 10007, .overlap = true});
      auto late = data_parallel(llama, c, 2, zero, {.bucket_bytes = 4 * 10007, .overlap = false});
      // Each bucket is reduced on its own, so the order of issue changes no bit.
      CHECK(early[0].params == late[0].params);
      CHECK(early[0].overlapped);
      CHECK_FALSE(late[0].overlapped);
      // Most of the ~80 buckets hold block parameters only and start inside backward.
      CHECK(early[0].early > 10);
      CHECK(late[0].early == 0);
    }
  }
}

TEST_CASE("ZeRO 1 gives each rank the optimizer state of its shard only", "[parallel]") {
  train_config c = tiny_run(4, 1);
  c.steps = 1;
  for (int zero : {0, 1, 2}) {
    c.plan.dp = 4;
    c.plan.zero = zero;
    auto comms = collective::make_local_group(4);
    std::vector<std::int64_t> elems(4);
    std::int64_t total = 0;
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r)
      threads.emplace_back([&, r] {
        auto m = make_causal_lm(tiny_model(false), {1, c.seq});
        total = m->memory().params().numel();
        dp_trainer t(*m, c, *comms[r], {.bucket_bytes = 4 * 1000});
        elems[r] = t.optimizer_elements();
      });
    for (auto& t : threads) t.join();
    INFO("zero " << zero);
    if (zero == 0) {
      for (auto e : elems) CHECK(e == total);
    } else {
      std::int64_t sum = 0;
      for (auto e : elems) {
        sum += e;
        CHECK(e <= total / 4 + 1000);
      }
      CHECK(sum == total);
    }
  }
}

// Not a test: tokens/s of dp 2 (two rank threads, one compute thread each) against the
// single-process trainer on two compute threads, and how much of the gradient reduction overlap
// hides. Run: troupe_models_tests "[.dp_bench]" (DP_BENCH_BUCKET_MB sets the bucket size).
TEST_CASE("Data parallel throughput against the single process trainer", "[.dp_bench]") {
  dp_options bench_opts;
  if (const char* e = std::getenv("DP_BENCH_BUCKET_MB"))
    bench_opts.bucket_bytes = static_cast<std::size_t>(std::atof(e) * (1 << 20));
  const char* names[] = {"gpt2-demo", "bench-small"};
  for (const char* name : names) {
    auto mc = named_model_config(name).value();
    train_config c;
    c.batch = 8;
    c.seq = 128;
    c.steps = 100;
    const int steps = 4;
    const double tokens = static_cast<double>(c.batch * c.seq * steps);
    auto source = [&](std::uint64_t d, int b, int t, std::vector<std::int32_t>& rows) {
      rows.resize(static_cast<std::size_t>(b) * t);
      for (std::size_t i = 0; i < rows.size(); ++i)
        rows[i] = static_cast<std::int32_t>((d * 7919 + i * 31 + i * i) %
                                            250);  // both vocabularies hold 250
    };
    troupe::parallel::set_num_threads(2);
    double single = 0;
    {
      auto m = make_causal_lm(mc, {c.batch, c.seq});
      m->init_weights(1);
      trainer t(*m, c);
      t.step(source);
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < steps; ++i) t.step(source);
      single = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    }
    std::printf("%s single process, 2 threads: %.0f tokens/s\n", name, tokens / single);
    troupe::parallel::set_num_threads(1);
    for (int zero : {0, 2}) {
      for (bool overlap : {false, true}) {
        train_config d = c;
        d.plan.dp = 2;
        d.plan.zero = zero;
        auto comms = collective::make_local_group(2);
        double secs = 0, wait = 0, total_wait = 0;
        std::vector<std::thread> threads;
        for (int r = 0; r < 2; ++r)
          threads.emplace_back([&, r] {
            auto m = make_causal_lm(mc, {dp_trainer::microbatch_rows(d), d.seq});
            m->init_weights(1);
            dp_options o = bench_opts;
            o.overlap = overlap;
            dp_trainer t(*m, d, *comms[r], o);
            t.step(source);
            auto t0 = std::chrono::steady_clock::now();
            double w = 0;
            for (int i = 0; i < steps; ++i) {
              t.step(source);
              w += t.last_comm_wait_seconds();
            }
            if (r == 0) {
              secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
              wait = w / steps;
              total_wait = w;
            }
          });
        for (auto& t : threads) t.join();
        std::printf(
            "%s dp2 zero %d overlap %d: %.0f tokens/s (%.2fx single), %.1f ms/step waiting on "
            "collectives (%.1f%% of the step)\n",
            name, zero, int(overlap), tokens / secs, single / secs, wait * 1e3,
            100 * total_wait / secs);
      }
    }
    troupe::parallel::set_num_threads(2);
  }
}

// dp 3 x pp 2 (6 threads): the tied wte lives on both pipeline stages, whose dp groups cut their
// buffers into different buckets, so with 3 ranks an element's gradient may be summed in another
// order on each stage. The two copies must stay equal bit for bit all the same (at dp 2 a sum of
// two is the same either way round, which is why dp 2 never showed a drift). ZeRO 1 and ZeRO 2
// with the full gradient buffer and giving the buckets back after the last microbatch's backward.
TEST_CASE("Tied embeddings stay identical on both pipeline stages at dp 3", "[parallel]") {
  using namespace troupe::models::parallel;
  constexpr int rows = 2, seq = 16, dp = 3, pp = 2, n = dp * pp;
  gpt_config cfg;
  cfg.vocab = 64;
  cfg.max_seq = seq;
  cfg.dim = 32;
  cfg.n_layer = 4;
  cfg.n_head = 4;
  train_config tc;
  tc.steps = 4;
  tc.batch = rows;
  tc.seq = seq;
  tc.grad_accum = 12;  // dp 3 x 4 microbatches of 2 rows
  tc.lr = 3e-3;
  tc.min_lr = 1e-3;
  tc.warmup = 2;
  tc.clip = 0.5;
  std::vector<step_result> ref;
  {
    causal_lm_of<gpt> single(cfg, batch_dims{rows, seq});
    single.init_weights(5);
    trainer t(single, tc);
    for (int s = 0; s < tc.steps; ++s) ref.push_back(t.step(synthetic_rows));
  }
  causal_lm_of<gpt> twin(cfg, batch_dims{rows, seq}, dtype::f64);
  twin.init_weights(5);
  const exact_run exact = exact_training(twin, tc, synthetic_rows);
  for (auto [zero, release] : {std::pair{1, false}, std::pair{2, false}, std::pair{2, true}}) {
    INFO("zero " << zero << " release_grads " << release);
    train_config c = tc;
    c.plan.dp = dp;
    c.plan.pp = pp;
    c.plan.zero = zero;
    c.plan.microbatches = 4;
    c.plan.schedule = scheduler::schedule_kind::one_f_one_b;
    auto world = std::make_shared<collective::local_world>(n);
    collective::rank_grid grid({{"dp", dp}, {"pp", pp}});
    // Per rank: its dp group, its pp group (send/recv only) and a second pp-axis group for the
    // norm.
    std::vector<std::vector<std::unique_ptr<collective::communicator>>> groups(n);
    for (int r = 0; r < n; ++r)
      for (const char* axis : {"dp", "pp", "pp"})
        groups[r].push_back(collective::make_communicator(
            world->transport(r), grid.group(r, {axis}),
            "local:" + std::to_string(groups[r].size()) + axis, world));
    std::vector<std::vector<step_result>> got(n);
    std::vector<std::vector<float>> wte(n);
    std::vector<char> released(n, 0);
    std::vector<std::exception_ptr> err(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        auto& g = groups[r];
        try {
          gpt_stage stage(cfg, batch_dims{rows, seq},
                          stage_options::of(c.plan, grid.coord(r, "pp")));
          stage.init_weights(5);
          pipeline_runner run(stage, *g[1], c.plan, g[2].get());
          dp_trainer t(run, c, *g[0], {.bucket_bytes = 4 * 1001, .release_grads = release});
          for (int s = 0; s < c.steps; ++s) got[r].push_back(t.step(synthetic_rows));
          released[r] = t.releases_grads() ? 1 : 0;
          const auto& slots = stage.slots().slots();
          auto it = std::find_if(slots.begin(), slots.end(), [](const tensor_slot& x) {
            return x.kind == slot_kind::param && x.name == "wte.weight";
          });
          if (it != slots.end())
            wte[r].assign(it->field->data_as<float>(),
                          it->field->data_as<float>() + it->field->numel());
        } catch (...) {
          err[r] = std::current_exception();
          for (auto& rank : groups)
            for (auto& comm : rank) comm->abort("rank " + std::to_string(r) + " failed");
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : err)
      if (e) std::rethrow_exception(e);
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r);
      CHECK(released[r] == (release ? 1 : 0));
      // The losses and norms are the single process's up to f32 summation order (exact_run.hpp).
      check_as_accurate(got[r], ref, exact);
      REQUIRE(!wte[r].empty());
      INFO("largest difference from rank 0's copy " << max_abs_diff(wte[r], wte[0]));
      const bool identical = wte[r] == wte[0];  // both stages of every replica: one set of bytes
      CHECK(identical);
    }
  }
}
