// The training loop: gradient accumulation equals the big batch, and a run resumed from a
// checkpoint equals the uninterrupted run.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <cstring>
#include <filesystem>
#include <memory>

#include "models/byte_data.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {
// Rows of `seq` tokens from a fixed pseudo-random stream, a pure function of the draw.
void synthetic_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3) % 29);
}

train_config tiny_run(std::int64_t steps) {
  train_config c;
  c.steps = steps;
  c.batch = 2;
  c.seq = 8;
  c.lr = 1e-2;
  c.min_lr = 1e-3;
  c.warmup = 2;
  return c;
}

hf::model_config tiny_model(bool llama) {
  return named_model_config(llama ? "llama-tiny" : "gpt2-demo", 29).value();
}
}  // namespace

namespace {
// a: the whole batch of 4 rows (f32, the reference); b: the same rows as two accumulated
// micro-batches of 2 (f32, under test); x: a in f64 from the same weights (exact); each with its
// trainer for `steps` steps, clipping off.
struct accumulation_runs {
  std::unique_ptr<causal_lm> a, b, x;
  std::unique_ptr<trainer> ta, tb, tx;

  accumulation_runs(bool llama, std::int64_t steps) {
    auto cfg = tiny_model(llama);
    a = make_causal_lm(cfg, {4, 8});
    b = make_causal_lm(cfg, {4, 8});
    x = make_causal_lm(cfg, {4, 8}, dtype::f64);
    a->init_weights(5);
    ops::copy(a->memory().params(), b->memory().params());
    ops::copy(a->memory().params(), x->memory().params());
    train_config ca = tiny_run(steps), cb = tiny_run(steps);
    ca.batch = 4;
    cb.batch = 2;
    cb.grad_accum = 2;
    cb.clip = ca.clip = 0;
    train_config cx = ca;
    cx.precision = "f64";
    ta = std::make_unique<trainer>(*a, ca);
    tb = std::make_unique<trainer>(*b, cb);
    tx = std::make_unique<trainer>(*x, cx);
  }

  // The step's gradients (unclipped) of b judged against a's, both against x's
  // (tests/rounding.hpp).
  tests::rounding_verdict gradients() const {
    auto ga = to_device(a->memory().grads(), device::cpu());
    auto gb = to_device(b->memory().grads(), device::cpu());
    auto gx = to_device(x->memory().grads(), device::cpu());
    const auto n = static_cast<std::size_t>(gx.numel());
    return tests::as_accurate_as(
        std::vector<float>(gb.data_as<float>(), gb.data_as<float>() + n),
        std::vector<float>(ga.data_as<float>(), ga.data_as<float>() + n),
        std::vector<double>(gx.data_as<double>(), gx.data_as<double>() + n));
  }
};

// Draw d as one batch (a and x) ...
void whole_batch(std::uint64_t d, int batch, int seq, std::vector<std::int32_t>& rows) {
  synthetic_rows(d, batch, seq, rows);
}
// ... and the same rows as two draws of half the rows (b).
void halves(std::uint64_t d, int batch, int seq, std::vector<std::int32_t>& rows) {
  std::vector<std::int32_t> all;
  synthetic_rows(d / 2, 2 * batch, seq, all);
  auto begin = all.begin() + static_cast<std::ptrdiff_t>((d % 2) * batch * seq);
  rows.assign(begin, begin + batch * seq);
}

}  // namespace

TEST_CASE("Two accumulated micro-batches give the gradient of the batch that holds both", "[cpu]") {
  for (bool llama : {false, true}) {
    INFO((llama ? "llama" : "gpt2"));
    accumulation_runs r(llama, 3);
    std::vector<double> loss_a, loss_b, loss_x, norm_a, norm_b, norm_x;
    for (int s = 0; s < 3; ++s) {
      INFO("step " << s);
      auto ra = r.ta->step(whole_batch);
      auto rb = r.tb->step(halves);
      auto rx = r.tx->step(whole_batch);
      loss_a.push_back(ra.loss);
      loss_b.push_back(rb.loss);
      loss_x.push_back(rx.loss);
      norm_a.push_back(ra.grad_norm);
      norm_b.push_back(rb.grad_norm);
      norm_x.push_back(rx.grad_norm);
      // b's gradients are as close to the exact ones as a's are, elementwise and at every step,
      // so after step 1 the rounding of the earlier updates counts too (AdamW magnifies it in
      // both runs alike).
      auto v = r.gradients();
      INFO("gradients: " << v.str());
      CHECK(v.ok());
    }
    auto vl = tests::as_accurate_as(loss_b, loss_a, loss_x, tests::trajectory_k);
    auto vn = tests::as_accurate_as(norm_b, norm_a, norm_x, tests::trajectory_k);
    INFO("losses: " << vl.str() << "; gradient norms: " << vn.str());
    CHECK(vl.ok());
    CHECK(vn.ok());
  }
}

TEST_CASE("The rounding judge fails an accumulation that drops a micro-batch", "[cpu]") {
  // The same three runs, but b sees the first half of the batch twice: its gradient is that of
  // another batch, which as_accurate_as must refuse.
  accumulation_runs r(true, 1);
  auto first_half = [](std::uint64_t d, int batch, int seq, std::vector<std::int32_t>& rows) {
    halves(d - d % 2, batch, seq, rows);
  };
  r.ta->step(whole_batch);
  r.tb->step(first_half);
  r.tx->step(whole_batch);
  auto v = r.gradients();
  INFO(v.str());
  CHECK(!v.ok());
  CHECK(v.ratio() > 1e3);
}

TEST_CASE("A run resumed from its checkpoint continues exactly like the uninterrupted run",
          "[cpu]") {
  namespace fs = std::filesystem;
  for (bool llama : {false, true}) {
    INFO((llama ? "llama" : "gpt2"));
    auto cfg = tiny_model(llama);
    fs::path dir = fs::temp_directory_path() /
                   ("troupe_resume_" + std::to_string(::getpid()) + (llama ? "_l" : "_g"));
    fs::remove_all(dir);
    std::vector<double> straight, resumed;
    {
      auto m = make_causal_lm(cfg, {2, 8});
      m->init_weights(11);
      trainer t(*m, tiny_run(6));
      for (int s = 0; s < 6; ++s) {
        straight.push_back(t.step(synthetic_rows).loss);
        if (s == 2) REQUIRE(t.save(dir, cfg).has_value());
      }
    }
    {
      auto m = make_causal_lm(cfg, {2, 8});
      m->init_weights(99);  // overwritten by the checkpoint
      trainer t(*m, tiny_run(6));
      auto step = t.resume(dir, cfg);
      REQUIRE(step.has_value());
      CHECK(*step == 3);
      for (int s = 3; s < 6; ++s) resumed.push_back(t.step(synthetic_rows).loss);
    }
    for (int s = 3; s < 6; ++s) CHECK(resumed[s - 3] == straight[s]);  // bit for bit
    fs::remove_all(dir);
  }
}

TEST_CASE("named model sizes are known and unknown ones are listed") {
  CHECK(named_model_config("gpt2-small").has_value());
  auto bad = named_model_config("gpt5");
  REQUIRE(!bad.has_value());
  CHECK_THAT(bad.error_message(), Catch::Contains("gpt5") && Catch::Contains("llama-tiny"));
}

TEST_CASE("bf16 mixed precision trains like f32 and keeps f32 master weights", "[cpu]") {
  auto cfg = tiny_model(false);
  auto m32 = make_causal_lm(cfg, {2, 8});
  auto m16 = make_causal_lm(cfg, {2, 8}, dtype::bf16);
  m32->init_weights(21);
  ops::copy(m32->memory().params(), m16->memory().params());
  train_config c32 = tiny_run(8), c16 = tiny_run(8);
  c32.lr = c16.lr = 2e-3;  // small steps: the runs stay close instead of diverging chaotically
  c16.precision = "bf16";
  trainer t32(*m32, c32), t16(*m16, c16);
  for (int s = 0; s < 8; ++s) {
    auto a = t32.step(synthetic_rows);
    auto b = t16.step(synthetic_rows);
    INFO("step " << s);
    CHECK(b.loss == Approx(a.loss).epsilon(2e-2));  // bf16 keeps 8 bits of mantissa
    CHECK(!b.skipped);
  }
  // The model holds the master weights rounded to bf16.
  auto master = to_device(m32->memory().params(), device::cpu());
  auto p16 = empty(m16->memory().params().sizes(), dtype::f32);
  ops::copy(m16->memory().params(), p16);
  double diff = 0;
  for (std::int64_t i = 0; i < p16.numel(); ++i)
    diff = std::max(diff, double(std::abs(p16.data_as<float>()[i] - master.data_as<float>()[i])));
  CHECK(diff < 8 * 2e-3);  // Adam moves a weight by at most ~lr per step
  CHECK(diff > 0);         // different arithmetic, not a copy of the f32 run
}

TEST_CASE("f16 skips steps whose gradients overflow and halves the loss scale", "[cpu]") {
  auto cfg = tiny_model(true);
  auto m = make_causal_lm(cfg, {2, 8}, dtype::f16);
  m->init_weights(3);
  ops::scale(m->memory().params(), 3000.0);  // activations overflow f16
  train_config c = tiny_run(4);
  c.precision = "f16";
  trainer t(*m, c);
  auto before = to_device(m->memory().params(), device::cpu());
  auto r = t.step(synthetic_rows);
  CHECK(r.skipped);
  CHECK(r.loss_scale == 65536.0);
  auto r2 = t.step(synthetic_rows);
  CHECK(r2.loss_scale == 32768.0);
  auto after = to_device(m->memory().params(), device::cpu());
  CHECK(std::memcmp(before.data(), after.data(), before.nbytes()) == 0);  // nothing applied
}

TEST_CASE("trainer refuses a precision its model was not built for") {
  auto m = make_causal_lm(tiny_model(false), {2, 8});
  train_config c = tiny_run(2);
  c.precision = "bf16";
  CHECK_THROWS_WITH(trainer(*m, c), Catch::Contains("precision bf16"));
}
