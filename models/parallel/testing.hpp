// Helpers for the tensor-parallel model tests (parallelize_gpt.test.cpp,
// parallelize_llama.test.cpp): one thread per rank of a local group, comparisons of flat f32
// buffers, and training a tp2 shard against the whole model.
#pragma once

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "collective/local/local_transport.hpp"
#include "models/causal_lm.hpp"
#include "models/parallel/tp_layers.hpp"
#include "models/trainer.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::testing {

inline std::vector<float> flat(const tensor& t) {
  const float* p = t.data_as<float>();
  return std::vector<float>(p, p + t.numel());
}

// max |a - b| over max |b| (a and b of the same length).
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0, s = 1e-12;
  for (std::size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
    s = std::max(s, static_cast<double>(std::abs(b[i])));
  }
  return m / s;
}

// fn(rank, communicator) on one thread per rank of a local group of n; the first failure is
// rethrown after every thread has ended.
inline void run_ranks(int n, const std::function<void(int, collective::communicator&)>& fn) {
  auto comms = collective::make_local_group(n);
  std::vector<std::exception_ptr> err(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r, *comms[r]);
      } catch (...) {
        err[r] = std::current_exception();
        for (auto& c : comms) c->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

// The single-process trainer runs unchanged on each of 2 tensor shards (causal_lm_of<Shard>, with
// and without SP) and on the whole model (causal_lm_of<Whole>) from the same seed, `steps` AdamW
// steps on one fixed batch (so the loss must fall); clipping is off (the trainer's norm would be
// per shard). Every shard's loss tracks the single process within 1e-4 relative per step.
template <class Whole, class Shard, class Config>
void check_tp2_training(const Config& cfg, int steps, const trainer::batch_source& rows) {
  train_config tc;
  tc.steps = steps;
  tc.batch = 2;
  tc.seq = 8;
  tc.lr = 1e-2;
  tc.min_lr = 1e-3;
  tc.warmup = 2;
  tc.clip = 0;
  tc.fixed_batch = true;
  batch_dims dims{tc.batch, tc.seq};
  std::vector<double> ref;
  {
    causal_lm_of<Whole> model(cfg, dims);
    model.init_weights(3);
    trainer t(model, tc);
    for (int s = 0; s < steps; ++s) ref.push_back(t.step(rows).loss);
  }
  for (bool sp : {false, true}) {
    INFO("sp " << sp);
    std::vector<std::vector<double>> got(2);
    run_ranks(2, [&](int r, collective::communicator& comm) {
      causal_lm_of<Shard> model(cfg, dims, tp_group{&comm, sp});
      model.init_weights(3);
      trainer t(model, tc);
      for (int s = 0; s < steps; ++s) got[r].push_back(t.step(rows).loss);
    });
    for (int r = 0; r < 2; ++r)
      for (int s = 0; s < steps; ++s) {
        INFO("rank " << r << " step " << s << " loss " << got[r][s] << " vs " << ref[s]);
        CHECK(std::abs(got[r][s] - ref[s]) <= 1e-4 * ref[s]);
      }
    CHECK(ref.back() < 0.8 * ref.front());  // it did train
  }
}

}  // namespace troupe::models::testing
