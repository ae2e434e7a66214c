// Helpers for the tensor-parallel model tests (parallelize_gpt.test.cpp,
// parallelize_llama.test.cpp): one thread per rank of a local group, comparisons of flat f32
// buffers, one step of tp shards against the unsharded model (with and without recompute), and
// training a tp2 shard against the whole model.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <catch2/catch.hpp>

#include "collective/local/local_transport.hpp"
#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/parallel/tp_layers.hpp"
#include "models/targets.hpp"
#include "models/trainer.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::testing {

// A GPT-2 of the given shape, every other setting at gpt_config's default (the pipeline tests'
// tiny model and gpt2-demo's shape at a chosen sequence length).
inline gpt_config gpt_shape(std::int64_t vocab, std::int64_t max_seq, std::int64_t dim,
                            std::int64_t n_layer, std::int64_t n_head) {
  gpt_config c;
  c.vocab = vocab;
  c.max_seq = max_seq;
  c.dim = dim;
  c.n_layer = n_layer;
  c.n_head = n_head;
  return c;
}

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

// fn(rank) on one thread per rank 0..n-1; a failing rank aborts every communicator of `comms`
// (null entries skipped, so the others do not wait for it) and the first failure is rethrown
// after every thread ended.
inline void run_threads(int n, const std::function<void(int)>& fn,
                        const std::vector<collective::communicator*>& comms) {
  std::vector<std::exception_ptr> err(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        err[r] = std::current_exception();
        for (auto* c : comms)
          if (c != nullptr) c->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

// fn(rank, communicator) on one thread per rank of a local group of n (run_threads).
inline void run_ranks(int n, const std::function<void(int, collective::communicator&)>& fn) {
  auto comms = collective::make_local_group(n);
  std::vector<collective::communicator*> all;
  for (auto& c : comms) all.push_back(c.get());
  run_threads(
      n, [&](int r) { fn(r, *comms[r]); }, all);
}

// A trainer::batch_source: draw `draw`'s rows, a fixed function of the draw and the position.
inline void synthetic_rows(std::uint64_t draw, int batch, int seq,
                           std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3) % 29);
}

// Token ids drawn uniformly from [0, vocab) (std::mt19937_64 seeded by `seed`) and their
// next-token targets, both i32 [rows, seq].
struct token_batch {
  owned_tensor ids, targets;
};

inline token_batch random_tokens(batch_dims dims, std::int64_t vocab, std::uint64_t seed) {
  token_batch b{empty({dims.batch, dims.seq}, dtype::i32),
                empty({dims.batch, dims.seq}, dtype::i32)};
  std::mt19937_64 g(seed);
  for (std::int64_t i = 0; i < b.ids.numel(); ++i)
    b.ids.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(g() % vocab);
  next_token_targets(b.ids, b.targets);
  return b;
}

// One forward and backward of `model` (its gradients zeroed first); returns the loss.
template <class Model>
double one_step(Model& model, const token_batch& b) {
  model.memory().zero_grads();
  double loss = model.forward(b.ids, b.targets);
  model.backward();
  return loss;
}

// What one shard got from one step, and what it should have got.
struct shard_step {
  double loss = 0;
  std::vector<float> grads;  // the shard's gradient buffer
  std::vector<float> want;   // the slice of the unsharded model's gradients, laid out as grads
  std::size_t activation_bytes = 0;
};

// One step on each of `tp` shards (threads of a local group). make(comm) returns a shard (a
// unique_ptr to tp_gpt, tp_llama, ...) holding the weights of the unsharded model `full`, whose
// gradients are those of the same step.
template <class Whole, class Make>
std::vector<shard_step> shard_steps(int tp, const Whole& full, const token_batch& b, Make make) {
  std::vector<shard_step> out(tp);
  run_ranks(tp, [&](int r, collective::communicator& comm) {
    auto m = make(comm);
    out[r].loss = one_step(*m, b);
    out[r].grads = flat(m->memory().grads());
    out[r].activation_bytes = m->memory().activation_bytes();
    m->load_from(full.slots(), /*from_grads=*/true, /*to_grads=*/false);
    out[r].want = flat(m->memory().params());
  });
  return out;
}

// Every shard's loss within 1e-5 relative of the unsharded `loss` (the vocab-parallel statistics
// are f64 sums rounded once) and its gradients within grad_tol of the largest element of its
// slice of the unsharded gradient (a wrong slice or a missing reduction is off by O(1)).
inline void check_shards(const std::vector<shard_step>& got, double loss, double grad_tol) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    const double e = rel_err(got[r].grads, got[r].want);
    INFO("rank " << r << " loss " << got[r].loss << " vs " << loss << ", gradient error " << e);
    CHECK(std::abs(got[r].loss - loss) <= 1e-5 * loss);
    CHECK(e < grad_tol);
  }
}

// Activation recompute on tp2 shards, with and without SP: the shards of cfg with recompute and
// without it (Shard(cfg, dims, tp_group), weights of an unsharded Whole(cfg) from init_weights(7)
// and then prepare) each match the unsharded model's loss and gradient slices (grad_tol), the
// recomputing shard's gradients equal the storing shard's to 1e-6 of the largest element (the
// same operations on the same inputs) and its activation arena is smaller.
template <class Whole, class Shard, class Config>
void check_tp2_recompute(Config cfg, batch_dims dims, double grad_tol,
                         const std::function<void(Whole&)>& prepare = {}) {
  cfg.recompute = false;
  Whole full(cfg, dims);
  full.init_weights(7);
  if (prepare) prepare(full);
  const token_batch b = random_tokens(dims, cfg.vocab, 9);
  const double loss = one_step(full, b);
  for (bool sp : {false, true}) {
    INFO("sp " << sp);
    auto run = [&](bool recompute) {
      Config c = cfg;
      c.recompute = recompute;
      return shard_steps(2, full, b, [&](collective::communicator& comm) {
        auto m = std::make_unique<Shard>(c, dims, tp_group{&comm, sp});
        m->load_from(full.slots());
        return m;
      });
    };
    const auto stored = run(false), recomputed = run(true);
    check_shards(stored, loss, grad_tol);
    check_shards(recomputed, loss, grad_tol);
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << " activation bytes " << recomputed[r].activation_bytes << " vs "
                   << stored[r].activation_bytes);
      CHECK(recomputed[r].loss == stored[r].loss);
      CHECK(rel_err(recomputed[r].grads, stored[r].grads) < 1e-6);
      CHECK(recomputed[r].activation_bytes < stored[r].activation_bytes);
    }
  }
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
