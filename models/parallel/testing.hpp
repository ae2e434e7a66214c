// Helpers for the parallel model tests (parallelize_gpt.test.cpp, parallelize_llama.test.cpp,
// pipeline tests, ...): one thread per rank of a local group, the f64 twin of a model and the
// rounding judge over its parameters (tests/rounding.hpp), one step of tp shards against the
// unsharded model (with and without recompute), and training a tp2 shard against the whole model.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <vector>

#include <catch2/catch.hpp>

#include "collective/local/local_transport.hpp"
#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/reshard.hpp"
#include "models/parallel/tp_layers.hpp"
#include "models/targets.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"
#include "tensor/tensor.hpp"
#include "tests/rounding.hpp"

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

// Every element of a host f32 or f64 tensor (contiguous), in f64.
inline std::vector<double> as_f64(const tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  if (t.type() == dtype::f64) {
    const double* p = t.data_as<double>();
    v.assign(p, p + t.numel());
  } else {
    REQUIRE(t.type() == dtype::f32);
    const float* p = t.data_as<float>();
    v.assign(p, p + t.numel());
  }
  return v;
}

// The parameter slot named `name` in `slots`; nullptr when absent.
inline const tensor_slot* param_slot(const slot_list& slots, std::string_view name) {
  for (const auto& s : slots.slots())
    if (s.kind == slot_kind::param && s.name == name) return &s;
  return nullptr;
}

// Every parameter of `to` from the parameter of the same name in `from` (any dtypes: f32 into
// f64 widens exactly).
inline void copy_params_by_name(const slot_list& from, const slot_list& to) {
  for (const auto& s : to.slots()) {
    if (s.kind != slot_kind::param) continue;
    const tensor_slot* f = param_slot(from, s.name);
    REQUIRE(f != nullptr);
    ops::copy(*f->field, *s.field);
  }
}

// The f64 twin of the f32 model `m` (gpt or llama): built in f64 for `dims`, holding m's weights
// widened exactly, so its forward and backward are the exact-arithmetic evaluation of m's - the
// "exact" of tests/rounding.hpp.
template <class Whole>
std::unique_ptr<Whole> f64_twin(const Whole& m, batch_dims dims) {
  auto x = std::make_unique<Whole>(m.config(), dims, dtype::f64);
  copy_params_by_name(m.slots(), x->slots());
  return x;
}

// A rounding verdict (tests/rounding.hpp) with what it judged.
struct named_verdict {
  std::string name;
  tests::rounding_verdict v;
  // err_got / bound: below 1 passes; how close a computation came to failing.
  double margin() const {
    return v.bound > 0 ? v.err_got / v.bound : (v.err_got > 0 ? INFINITY : 0.0);
  }
};

// Every parameter of `got` judged by name: its gradient (grads, else its weight) must be as
// accurate as `ref`'s (the single-process f32 model's) against `exact`'s (ref's f64 twin), each
// parameter by its own scale (tests::as_accurate_as). Returns the worst (largest margin) verdict.
inline named_verdict worst_by_name(const slot_list& got, const slot_list& ref,
                                   const slot_list& exact, bool grads = true,
                                   double k = tests::default_k) {
  named_verdict worst;
  bool have = false;
  for (const auto& s : got.slots()) {
    if (s.kind != slot_kind::param) continue;
    const tensor_slot* r = param_slot(ref, s.name);
    const tensor_slot* x = param_slot(exact, s.name);
    REQUIRE(r != nullptr);
    REQUIRE(x != nullptr);
    auto pick = [&](const tensor_slot& t) { return as_f64(grads ? *t.grad : *t.field); };
    named_verdict nv{s.name, tests::as_accurate_as(pick(s), pick(*r), pick(*x), k)};
    // The first failure, else the largest margin.
    if (!have || (worst.v.ok() && (!nv.v.ok() || nv.margin() > worst.margin()))) worst = nv;
    have = true;
  }
  return worst;
}

// A piece's (a tensor shard's or a pipeline stage's) slices of the f64 model `full`'s gradients
// (grads, else its weights), in f64, laid out like the piece's flat parameter buffer `base`: cut
// by copy_slice as the piece cuts its own, without rounding them to f32.
inline std::vector<double> exact_slices(const slot_list& piece, const tensor& base, int tp_rank,
                                        int tp, const slot_list& full, bool grads = true) {
  owned_tensor out = zeros({base.numel()}, dtype::f64);
  for (const auto& s : piece.slots()) {
    if (s.kind != slot_kind::param) continue;
    const tensor_slot* f = param_slot(full, s.name);
    REQUIRE(f != nullptr);
    const tensor dst =
        out.narrow(0, parallel::offset_in(*s.field, base), s.field->numel()).reshape(s.sizes);
    copy_slice(s, grads ? *f->grad : *f->field, dst, tp_rank, tp, /*into_shard=*/true,
               "exact_slices");
  }
  return as_f64(out);
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

// An unsharded f32 model after one step and its f64 twin (f64_twin) after the same step.
template <class Whole>
struct whole_step {
  const Whole& full;
  double loss;
  const Whole& exact;
  double exact_loss;
};

// What one shard got from one step, and what it should have got.
struct shard_step {
  double loss = 0;
  std::vector<float> grads;   // the shard's gradient buffer
  std::vector<float> want;    // the slice of the unsharded f32 model's gradients, laid out as grads
  std::vector<double> exact;  // the same slice of its f64 twin's gradients
  std::size_t activation_bytes = 0;
};

// One step on each of `tp` shards (threads of a local group). make(comm) returns a shard (a
// unique_ptr to tp_gpt, tp_llama, ...) holding the weights of the unsharded model `w.full`, whose
// gradients (and its f64 twin's, w.exact) are those of the same step.
template <class Whole, class Make>
std::vector<shard_step> shard_steps(int tp, const whole_step<Whole>& w, const token_batch& b,
                                    Make make) {
  std::vector<shard_step> out(tp);
  run_ranks(tp, [&](int r, collective::communicator& comm) {
    auto m = make(comm);
    out[r].loss = one_step(*m, b);
    out[r].grads = flat(m->memory().grads());
    out[r].activation_bytes = m->memory().activation_bytes();
    out[r].exact = exact_slices(m->slots(), m->memory().params(), r, tp, w.exact.slots());
    m->load_from(w.full.slots(), /*from_grads=*/true, /*to_grads=*/false);
    out[r].want = flat(m->memory().params());
  });
  return out;
}

// Every shard's loss and gradient slice as accurate as the unsharded f32 model's, against its
// f64 twin (tests/rounding.hpp: the shards add the same terms split across ranks, reduced in
// another order). A wrong slice, a missing reduction or RoPE at the wrong positions is off by
// O(|gradient|), 1e3 or more times the bound.
template <class Whole>
void check_shards(const std::vector<shard_step>& got, const whole_step<Whole>& w) {
  for (std::size_t r = 0; r < got.size(); ++r) {
    auto vl = tests::as_accurate_as(std::vector<double>{got[r].loss}, std::vector<double>{w.loss},
                                    std::vector<double>{w.exact_loss});
    auto vg = tests::as_accurate_as(got[r].grads, got[r].want, got[r].exact);
    INFO("rank " << r << " loss " << got[r].loss << " vs " << w.loss << ": " << vl.str());
    INFO("gradients: " << vg.str());
    CHECK(vl.ok());
    CHECK(vg.ok());
  }
}

// Activation recompute on tp2 shards, with and without SP: the shards of cfg with recompute and
// without it (Shard(cfg, dims, tp_group), weights of an unsharded Whole(cfg) from init_weights(7)
// and then prepare) each match the unsharded model's loss and gradient slices (check_shards), and
// the recomputing shard's loss and gradients equal the storing shard's bit for bit (the same
// kernels on the same inputs in the same order: a recomputed forward reproduces the stored
// activations exactly on any CPU) and its activation arena is smaller.
template <class Whole, class Shard, class Config>
void check_tp2_recompute(Config cfg, batch_dims dims,
                         const std::function<void(Whole&)>& prepare = {}) {
  cfg.recompute = false;
  Whole full(cfg, dims);
  full.init_weights(7);
  if (prepare) prepare(full);
  auto exact = f64_twin(full, dims);
  const token_batch b = random_tokens(dims, cfg.vocab, 9);
  const whole_step<Whole> w{full, one_step(full, b), *exact, one_step(*exact, b)};
  for (bool sp : {false, true}) {
    INFO("sp " << sp);
    auto run = [&](bool recompute) {
      Config c = cfg;
      c.recompute = recompute;
      return shard_steps(2, w, b, [&](collective::communicator& comm) {
        auto m = std::make_unique<Shard>(c, dims, tp_group{&comm, sp});
        m->load_from(full.slots());
        return m;
      });
    };
    const auto stored = run(false), recomputed = run(true);
    check_shards(stored, w);
    check_shards(recomputed, w);
    for (int r = 0; r < 2; ++r) {
      INFO("rank " << r << " activation bytes " << recomputed[r].activation_bytes << " vs "
                   << stored[r].activation_bytes);
      CHECK(recomputed[r].loss == stored[r].loss);
      CHECK(recomputed[r].grads == stored[r].grads);
      CHECK(recomputed[r].activation_bytes < stored[r].activation_bytes);
    }
  }
}

// The single-process trainer runs unchanged on each of 2 tensor shards (causal_lm_of<Shard>, with
// and without SP) and on the whole model (causal_lm_of<Whole>) from the same seed, `steps` AdamW
// steps on one fixed batch (so the loss must fall); clipping is off (the trainer's norm would be
// per shard). Every shard's losses must be as accurate as the single process's against the same
// run in f64 (precision "f64": weights, gradients and AdamW state; tests/rounding.hpp), judged over
// the whole trajectory, where AdamW magnifies early rounding in both f32 runs alike. A shard that
// dropped a reduction or a step would be off by O(lr) in its weights, O(1e-2) in its loss.
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
  auto run = [&](causal_lm& model, const train_config& c) {
    model.init_weights(3);
    trainer t(model, c);
    std::vector<double> losses;
    for (int s = 0; s < steps; ++s) losses.push_back(t.step(rows).loss);
    return losses;
  };
  std::vector<double> ref, exact;
  {
    causal_lm_of<Whole> model(cfg, dims);
    ref = run(model, tc);
  }
  {
    causal_lm_of<Whole> model(cfg, dims, dtype::f64);
    train_config c = tc;
    c.precision = "f64";
    exact = run(model, c);
  }
  for (bool sp : {false, true}) {
    INFO("sp " << sp);
    std::vector<std::vector<double>> got(2);
    run_ranks(2, [&](int r, collective::communicator& comm) {
      causal_lm_of<Shard> model(cfg, dims, tp_group{&comm, sp});
      got[r] = run(model, tc);
    });
    for (int r = 0; r < 2; ++r) {
      auto v = tests::as_accurate_as(got[r], ref, exact, tests::trajectory_k);
      INFO("rank " << r << " losses: " << v.str());
      CHECK(v.ok());
    }
    CHECK(ref.back() < 0.8 * ref.front());  // it did train
  }
}

}  // namespace troupe::models::testing
