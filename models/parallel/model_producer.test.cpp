// dp_trainer over grad_producers other than a whole model: a tensor-parallel GPT-2 shard
// (model_producer with the tp norm group) in a dp2 x tp2 grid against the single-process trainer
// with clipping active, and a recording producer that checks the rows fetch hands it.
#include <catch2/catch.hpp>

#include <cmath>
#include <exception>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "models/gpt.hpp"
#include "models/llama.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/model_producer.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/testing.hpp"
#include "models/trainer.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;

namespace {

void synthetic_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3 + (i * draw) % 5) % 29);
}

gpt_config tiny() {
  gpt_config c;
  c.vocab = 32;
  c.max_seq = 8;
  c.dim = 32;
  c.n_layer = 2;
  c.n_head = 4;
  return c;
}

train_config tiny_run() {
  train_config c;
  c.steps = 10;
  c.batch = 4;
  c.seq = 8;
  c.lr = 3e-3;
  c.min_lr = 1e-3;
  c.warmup = 2;
  c.clip = 0.05;  // below every step's norm: clipping scales each update
  return c;
}

struct grid_run {
  std::vector<std::vector<step_result>> steps;  // per world rank
  // Per world rank: the shard's final weights judged against the reference's slice by the f64
  // reference's slice (tests/rounding.hpp).
  std::vector<tests::rounding_verdict> weights;
};

// dp2 x tp2 over one local world: world rank = dp * 2 + tp. tp_norm: the producer sums the norm
// over the tp group (else each shard's norm is its own, which is wrong).
// reference and exact (null: no weights judged): the single-process trainer's model after the
// same steps in f32 and in f64.
grid_run dp_tp(const train_config& base, int zero, bool sp, bool tp_norm, int steps,
               causal_lm_of<gpt>* reference, causal_lm_of<gpt>* exact) {
  train_config c = base;
  c.plan.dp = 2;
  c.plan.tp = 2;
  c.plan.zero = zero;
  c.plan.sp = sp;
  const gpt_config cfg = tiny();
  auto world = std::make_shared<collective::local_world>(4);
  collective::rank_grid grid({{"dp", 2}, {"tp", 2}});
  std::vector<std::unique_ptr<collective::communicator>> dps(4), tps(4);
  std::vector<collective::communicator*> all;
  for (int r = 0; r < 4; ++r) {
    dps[r] = collective::make_communicator(world->transport(r), grid.group(r, {"dp"}), "local:dp",
                                           world);
    tps[r] = collective::make_communicator(world->transport(r), grid.group(r, {"tp"}), "local:tp",
                                           world);
    all.push_back(dps[r].get());
    all.push_back(tps[r].get());
  }
  grid_run out;
  out.steps.resize(4);
  out.weights.resize(4);
  testing::run_threads(
      4,
      [&](int r) {
        batch_dims dims{dp_trainer::microbatch_rows(c), c.seq};
        causal_lm_of<tp_gpt> shard(cfg, dims, tp_group{tps[r].get(), sp});
        shard.init_weights(3);
        auto producer = tp_norm ? std::make_unique<model_producer>(shard, *tps[r])
                                : std::make_unique<model_producer>(shard);
        dp_trainer t(*producer, c, *dps[r],
                     {.bucket_bytes = 4 * 1009, .poison_released = zero == 3});
        for (int s = 0; s < steps; ++s) out.steps[r].push_back(t.step(synthetic_rows));
        t.gather_full_parameters();
        if (reference == nullptr) return;
        tp_gpt want(cfg, dims, tp_group{tps[r].get(), sp});
        want.load_from(reference->model().slots());
        REQUIRE(shard.memory().params().numel() == want.memory().params().numel());
        out.weights[r] = tests::as_accurate_as(
            testing::as_f64(shard.memory().params()), testing::as_f64(want.memory().params()),
            testing::exact_slices(shard.slots(), shard.memory().params(), tps[r]->rank(), 2,
                                  exact->slots(), /*grads=*/false));
      },
      all);
  return out;
}

}  // namespace

// The declarations (param_spec) are checked against an independent rule: a shard's parameter is
// replicated exactly when its shape equals the unsharded model's shape of the same name (a split
// axis is divided by tp = 2, so it cannot agree). Both families, fused and separate projections.
template <class Shard, class Whole, class Config>
void check_declared_replication(const Config& cfg) {
  auto comms = collective::make_local_group(2);
  causal_lm_of<Shard> shard(cfg, batch_dims{1, 8}, tp_group{comms[0].get(), false});
  Whole full(cfg, {1, 8});
  int counted = 0, total = 0;
  model_producer rank0(shard, *comms[0]), rank1(shard, *comms[1]);
  for (const auto& s : shard.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    INFO(s.name);
    ++total;
    const tensor_slot* f = testing::param_slot(full.slots(), s.name);
    REQUIRE(f != nullptr);
    const bool same_shape = f->sizes == s.sizes;
    CHECK(replicated_over_tp(s) == same_shape);
    CHECK(f->spec.split == s.spec.split);  // the whole model declares what its shards hold
    CHECK(rank0.counts_in_norm(s));
    counted += rank1.counts_in_norm(s) ? 1 : 0;
    CHECK(rank1.counts_in_norm(s) == !same_shape);
  }
  CHECK(counted > 0);
  CHECK(counted < total);
}

TEST_CASE("Replicated parameters of tensor parallel shards are the ones declared replicated",
          "[parallel]") {
  SECTION("GPT-2") {
    const gpt_config cfg = tiny();
    check_declared_replication<tp_gpt, gpt>(cfg);
    auto comms = collective::make_local_group(2);
    causal_lm_of<tp_gpt> shard(cfg, batch_dims{1, 8}, tp_group{comms[0].get(), false});
    for (const char* name : {"h.0.ln_1.weight", "ln_f.bias", "wpe.weight", "h.0.attn.o_proj.bias"})
      CHECK(replicated_over_tp(*testing::param_slot(shard.slots(), name)));
    CHECK_FALSE(replicated_over_tp(*testing::param_slot(shard.slots(), "wte.weight")));
  }
  SECTION("Llama with grouped-query heads and an untied head") {
    llama_config cfg;
    cfg.vocab = 32;
    cfg.dim = 16;
    cfg.n_layer = 2;
    cfg.n_head = 4;
    cfg.n_kv_head = 2;
    cfg.hidden = 24;
    cfg.max_seq = 8;
    cfg.attention_bias = true;
    check_declared_replication<tp_llama, llama>(cfg);
  }
}

// The tp-aware norm: with a clip below every step's norm, each update is scaled by clip / norm, so
// a wrong norm changes every step's weights. Losses, norms and final weights as accurate as the
// single process's against the same run in f64 (tests/rounding.hpp: summation order only, which
// AdamW magnifies in both f32 runs alike; a wrong norm scales every update, O(lr) in the weights).
TEST_CASE(
    "Data parallel training of tensor parallel GPT-2 shards with clipping matches the "
    "single process trainer",
    "[parallel]") {
  const train_config c = tiny_run();
  causal_lm_of<gpt> ref_model(tiny(), batch_dims{c.batch, c.seq});
  causal_lm_of<gpt> exact_model(tiny(), batch_dims{c.batch, c.seq}, dtype::f64);
  std::vector<step_result> ref;
  std::vector<double> ref_loss, ref_norm, exact_loss, exact_norm;
  for (bool f64 : {false, true}) {
    causal_lm& m = f64 ? static_cast<causal_lm&>(exact_model) : ref_model;
    m.init_weights(3);
    train_config cm = c;
    if (f64) cm.precision = "f64";
    trainer t(m, cm);
    for (int s = 0; s < c.steps; ++s) {
      auto res = t.step(synthetic_rows);
      if (!f64) ref.push_back(res);
      (f64 ? exact_loss : ref_loss).push_back(res.loss);
      (f64 ? exact_norm : ref_norm).push_back(res.grad_norm);
    }
  }
  for (const auto& r : ref) CHECK(r.grad_norm > 2 * c.clip);
  struct plan_case {
    int zero;
    bool sp;
  };
  for (auto pc : {plan_case{1, false}, plan_case{3, true}}) {
    INFO("zero " << pc.zero << " sp " << pc.sp);
    auto run = dp_tp(c, pc.zero, pc.sp, true, c.steps, &ref_model, &exact_model);
    for (int r = 0; r < 4; ++r) {
      std::vector<double> loss, norm;
      for (const auto& g : run.steps[r]) loss.push_back(g.loss), norm.push_back(g.grad_norm);
      auto vl = tests::as_accurate_as(loss, ref_loss, exact_loss, tests::trajectory_k);
      auto vn = tests::as_accurate_as(norm, ref_norm, exact_norm, tests::trajectory_k);
      INFO("world rank " << r << " losses: " << vl.str() << "; norms: " << vn.str()
                         << "; weights: " << run.weights[r].str());
      CHECK(vl.ok());
      CHECK(vn.ok());
      CHECK(run.weights[r].ok());
    }
  }
  // The test can fail: without the tp norm group each shard clips by its own norm (about
  // 1 / sqrt(2) of the whole one: off by tens of percent, not by rounding).
  auto naive = dp_tp(c, 1, false, false, 1, nullptr, nullptr);
  for (int r = 0; r < 4; ++r)
    CHECK(std::abs(naive.steps[r][0].grad_norm - ref[0].grad_norm) > 1e-3 * ref[0].grad_norm);
}

namespace {

// Records what fetch gives it (its gradients stay zero). Parameters in two blocks (h.0, h.1) and
// one outside (head); it calls the block hook for both blocks after its last microbatch.
class recording_producer final : public grad_producer {
 public:
  struct seen {
    std::vector<std::int32_t> ids, targets;
    std::int64_t rows = 0, seq = 0;
    double weight = 0;
  };
  recording_producer() {
    for (int i = 0; i < 2; ++i) {
      const auto mark = slots_.mark_block(i);
      slots_.param("h." + std::to_string(i) + ".w", {4}, w_[i], g_[i]);
    }
    slots_.param("head.w", {3}, w_[2], g_[2]);
    mem_ = layer_memory(slots_, dtype::f32);
  }
  layer_memory& memory() override { return mem_; }
  const slot_list& slots() const override { return slots_; }
  bool set_block_grads_hook(std::function<void(std::int64_t)> f) override {
    hook_ = std::move(f);
    return true;
  }
  double forward_backward(int microbatches,
                          const std::function<microbatch_data(int k)>& fetch) override {
    double loss = 0;
    steps_.emplace_back();
    for (int k = 0; k < microbatches; ++k) {
      microbatch_data mb = fetch(k);
      seen s;
      s.rows = mb.ids.size(0);
      s.seq = mb.ids.size(1);
      s.ids.assign(mb.ids.data_as<std::int32_t>(), mb.ids.data_as<std::int32_t>() + mb.ids.numel());
      s.targets.assign(mb.targets.data_as<std::int32_t>(),
                       mb.targets.data_as<std::int32_t>() + mb.targets.numel());
      s.weight = mb.weight;
      double sum = 0;
      for (auto v : s.ids) sum += v;
      loss += mb.weight * sum;
      steps_.back().push_back(std::move(s));
    }
    if (hook_) {
      hook_(1);
      hook_(0);
    }
    return loss;
  }
  std::vector<std::vector<seen>> steps_;

 private:
  tensor w_[3], g_[3];
  slot_list slots_;
  layer_memory mem_;
  std::function<void(std::int64_t)> hook_;
};

}  // namespace

TEST_CASE("dp_trainer hands a custom grad producer the rows of its microbatches", "[parallel]") {
  train_config c;
  c.steps = 3;
  c.batch = 2;
  c.grad_accum = 4;  // 8 samples per step: 2 ranks x 2 microbatches x 2 rows
  c.seq = 8;
  c.clip = 0;
  c.plan.dp = 2;
  c.plan.microbatches = 2;
  c.plan.zero = 2;
  const int dp = 2, m = 2, steps = 3;
  const std::int64_t g = c.batch * c.grad_accum, n = g / (dp * m);
  auto comms = collective::make_local_group(dp);
  std::vector<std::unique_ptr<recording_producer>> producers;
  for (int r = 0; r < dp; ++r) producers.push_back(std::make_unique<recording_producer>());
  std::vector<std::vector<double>> losses(dp);
  std::vector<std::int64_t> early(dp);
  testing::run_threads(dp,
                       [&](int r) {
                         dp_trainer t(*producers[r], c, *comms[r], {.bucket_bytes = 4 * 2});
                         for (int s = 0; s < steps; ++s) {
                           losses[r].push_back(t.step(synthetic_rows).loss);
                           early[r] += t.buckets_issued_in_backward();
                         }
                       },
                       {comms[0].get(), comms[1].get()});
  std::vector<std::int32_t> draw;
  for (int s = 0; s < steps; ++s) {
    double want_loss = 0;
    for (int r = 0; r < dp; ++r) {
      REQUIRE(producers[r]->steps_.size() == static_cast<std::size_t>(steps));
      const auto& got = producers[r]->steps_[s];
      REQUIRE(got.size() == static_cast<std::size_t>(m));
      for (int k = 0; k < m; ++k) {
        INFO("step " << s << " rank " << r << " microbatch " << k);
        CHECK(got[k].rows == n);
        CHECK(got[k].seq == c.seq);
        CHECK(got[k].weight == Approx(static_cast<double>(n) / g));
        // Megatron's layout: microbatch k of rank r is the (k * dp + r)-th run of n samples of
        // the step; sample i is row i mod batch of draw i / batch.
        double sum = 0;
        for (std::int64_t j = 0; j < n; ++j) {
          std::int64_t i = s * g + (k * dp + r) * n + j;
          synthetic_rows(static_cast<std::uint64_t>(i / c.batch), static_cast<int>(c.batch),
                         static_cast<int>(c.seq), draw);
          for (std::int64_t p = 0; p < c.seq; ++p) {
            std::int32_t id = draw[(i % c.batch) * c.seq + p];
            CHECK(got[k].ids[j * c.seq + p] == id);
            sum += id;
            if (p > 0) CHECK(got[k].targets[j * c.seq + p - 1] == id);
          }
          CHECK(got[k].targets[j * c.seq + c.seq - 1] == -100);
        }
        want_loss += static_cast<double>(n) / g * sum;
      }
    }
    // The loss is an f64 weighted sum of integers, added in another order: 1e-12 is f64
    // rounding with a margin of 1e3 (no f32 anywhere).
    for (int r = 0; r < dp; ++r) CHECK(losses[r][s] == Approx(want_loss).epsilon(1e-12));
  }
  // The h.0 and h.1 buckets started from the hook.
  for (int r = 0; r < dp; ++r) CHECK(early[r] > 0);
}
