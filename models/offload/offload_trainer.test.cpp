// The offloaded trainer against models/trainer.hpp's unconstrained run on gpt: the same losses and
// weights when the budgets force parameters and optimizer state to the host, to NVMe, or let the
// automatic placement split them.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "memory/buffer.hpp"
#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/training_state.hpp"
#include "models/offload/offload_trainer.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;
using memory::tier;

namespace {

gpt_config tiny_gpt() {
  return {.vocab = 64, .max_seq = 16, .dim = 32, .n_layer = 3, .n_head = 4};
}

train_config tiny_train() {
  train_config c;
  c.batch = 2;
  c.seq = 16;
  c.steps = 20;
  c.warmup = 2;
  c.lr = 1e-2;
  c.clip = 0.5;  // small enough that clipping acts
  c.decay_exempt = true;
  return c;
}

void random_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  std::mt19937_64 gen(1000 + draw);
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (auto& r : rows) r = static_cast<std::int32_t>(gen() % 64);
}

struct outcome {
  std::vector<double> losses;
  std::vector<float> weights;  // the gpt's flat parameter buffer
};

constexpr int steps = 4;

std::vector<float> values(const tensor& t) {
  return {static_cast<const float*>(t.data()), static_cast<const float*>(t.data()) + t.numel()};
}

// The gpt parameters an offloaded trainer holds now, flat.
std::vector<float> weights_of(offload_trainer& off) {
  causal_lm_of<gpt> out(tiny_gpt(), batch_dims{2, 16});
  off.copy_weights_to(out.slots());
  return values(out.memory().params());
}

// The plain trainer's run; `moments`: its AdamW m and v at the end, flat.
outcome reference_run(const train_config& cfg = tiny_train(), int n = steps,
                      std::vector<float>* moments = nullptr) {
  causal_lm_of<gpt> m(tiny_gpt(), batch_dims{2, 16});
  m.init_weights(5);
  trainer tr(m, cfg);
  outcome o;
  bool clipped = false;
  for (int s = 0; s < n; ++s) {
    auto r = tr.step(random_rows);
    o.losses.push_back(r.loss);
    clipped = clipped || r.grad_norm > tiny_train().clip;
  }
  CHECK(clipped);  // the comparison covers the clipping
  if (moments)
    for (const tensor* t : {&tr.optimizer().m(), &tr.optimizer().v()})
      moments->insert(moments->end(), static_cast<const float*>(t->data()),
                      static_cast<const float*>(t->data()) + t->numel());
  o.weights = values(m.memory().params());
  return o;
}

outcome offloaded_run(const offload_options& opt, memory::tier_report* rep = nullptr,
                      offload_trainer** keep = nullptr, const train_config& cfg = tiny_train()) {
  causal_lm_of<gpt> init(tiny_gpt(), batch_dims{2, 16});
  init.init_weights(5);
  offload_trainer off(tiny_gpt(), cfg, opt);
  off.set_weights(init.slots());
  outcome o;
  for (int s = 0; s < steps; ++s) o.losses.push_back(off.step(random_rows).loss);
  if (rep) *rep = off.tiers().report();
  o.weights = weights_of(off);
  (void)keep;
  return o;
}

void require_same(const outcome& ref, const outcome& off, bool trains = true) {
  REQUIRE(ref.losses.size() == off.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    INFO("step " << i << ": " << ref.losses[i] << " vs " << off.losses[i]);
    CHECK(ref.losses[i] == off.losses[i]);
  }
  REQUIRE(ref.weights.size() == off.weights.size());
  double worst = 0;
  std::size_t differ = 0;
  for (std::size_t i = 0; i < ref.weights.size(); ++i) {
    const double a = ref.weights[i], b = off.weights[i];
    differ += a != b;
    worst = std::max(worst, std::abs(a - b) / std::max(std::abs(a), 1e-3));
  }
  // Bit for bit on any CPU: the offloaded trainer runs the same kernels in the same order on the
  // same values (paging moves bytes, it does no arithmetic); `worst` only says how far a
  // difference went when there is one.
  INFO("weights differing: " << differ << " of " << ref.weights.size() << ", worst " << worst);
  CHECK(differ == 0);
  if (trains) CHECK(ref.losses[steps - 1] < ref.losses[0]);  // it trains
}

offload_options base_options() {
  offload_options o;
  o.chunk_candidates = {16384};  // small chunks, so that this small model spans many
  return o;
}

std::size_t chunk_bytes_of(const offload_options&) {
  offload_trainer probe(tiny_gpt(), tiny_train(), base_options());
  return probe.chunking().layout.chunk_bytes;
}

// The device budget: the non-model memory and `extra` chunk slots beyond what a step pins.
std::size_t tight_device(const offload_options& o, std::size_t extra) {
  offload_options big = o;
  big.device_bytes = std::size_t{1} << 30;
  offload_trainer probe(tiny_gpt(), tiny_train(), big);
  return probe.non_model_bytes() +
         (probe.pinned_at_once(tier::device) + extra) * probe.chunking().layout.chunk_bytes;
}

std::size_t non_model() {
  offload_options o = base_options();
  o.device_bytes = std::size_t{1} << 30;
  offload_trainer probe(tiny_gpt(), tiny_train(), o);
  return probe.non_model_bytes();
}

}  // namespace

TEST_CASE("offloaded training keeps parameters and optimizer state on the host", "[offload]") {
  const outcome ref = reference_run();
  offload_options o = base_options();
  o.placement = {.param_fraction = 1, .optim_fraction = 1};
  const std::size_t cb = chunk_bytes_of(o);
  REQUIRE(cb == 16384);
  o.device_bytes = tight_device(o, 2);
  memory::tier_report rep;
  const outcome off = offloaded_run(o, &rep);
  require_same(ref, off);
  offload_trainer probe(tiny_gpt(), tiny_train(), o);
  INFO("chunks " << probe.chunk_count() << ", model state " << probe.model_state_bytes());
  CHECK(probe.model_state_bytes() > 3 * (o.device_bytes - non_model()));  // cannot be resident
  probe.check_budgets();
  CHECK(probe.optimizer_overlaps());  // the host holds two chunk groups: the update overlaps
  CHECK(rep.device_peak <= o.device_bytes);
  CHECK(rep.evictions > 0);
  CHECK(rep.prefetches > 0);
  CHECK(rep.hit_rate() > 0.5);
}

TEST_CASE("offloaded training pages parameters and optimizer state to nvme", "[offload]") {
  const outcome ref = reference_run();
  auto dir = std::filesystem::temp_directory_path() / "troupe_offload_test_nvme";
  std::filesystem::remove_all(dir);
  offload_options o = base_options();
  o.placement = {
      .param_fraction = 1, .optim_fraction = 1, .param_tier = tier::nvme, .optim_tier = tier::nvme};
  const std::size_t cb = chunk_bytes_of(o);
  o.nvme_dir = dir.string();
  o.device_bytes = tight_device(o, 2);
  o.host_bytes = 6 * cb;
  memory::tier_report rep;
  const outcome off = offloaded_run(o, &rep);
  require_same(ref, off);
  CHECK(rep.nvme_write_bytes > 0);
  CHECK(rep.nvme_read_bytes > 0);
  offload_trainer probe(tiny_gpt(), tiny_train(), o);
  probe.check_budgets();
  CHECK_FALSE(probe.optimizer_overlaps());  // six host slots: one group at a time
  CHECK(rep.host_used <= o.host_bytes);
  CHECK(rep.device_peak <= o.device_bytes);
  std::filesystem::remove_all(dir);
}

TEST_CASE("automatic placement keeps what fits resident and trains the same", "[offload]") {
  const outcome ref = reference_run();
  offload_options o = base_options();
  o.placement.how = offload_placement::mode::automatic;
  const std::size_t cb = chunk_bytes_of(o);
  o.device_bytes = non_model() + 24 * cb;
  offload_trainer probe(tiny_gpt(), tiny_train(), o);
  int resident = 0, state_resident = 0;
  for (std::int32_t i = 0; i < probe.chunk_count(); ++i) {
    resident += probe.param_home(i) == tier::device;
    state_resident += probe.optim_home(i) == tier::device;
  }
  INFO("chunks " << probe.chunk_count() << " resident " << resident << " state " << state_resident);
  CHECK(resident > 0);
  CHECK(resident < probe.chunk_count());
  require_same(ref, offloaded_run(o));
  // With room for everything, everything stays on the device.
  o.device_bytes = std::size_t{1} << 30;
  offload_trainer roomy(tiny_gpt(), tiny_train(), o);
  for (std::int32_t i = 0; i < roomy.chunk_count(); ++i) {
    CHECK(roomy.param_home(i) == tier::device);
    CHECK(roomy.optim_home(i) == tier::device);
  }
}

TEST_CASE("offloaded training with gradient accumulation matches the plain trainer", "[offload]") {
  train_config cfg = tiny_train();
  cfg.grad_accum = 3;
  const outcome ref = reference_run(cfg);
  offload_options o = base_options();
  o.placement = {.param_fraction = 1, .optim_fraction = 1};
  o.device_bytes = tight_device(o, 2);
  memory::tier_report rep;
  const outcome off = offloaded_run(o, &rep, nullptr, cfg);
  require_same(ref, off, false);  // (three random batches a step: the loss is noisy)
  CHECK(rep.evictions > 0);       // the micro-batches page the parameters in again
  // Not the same as one micro-batch: the comparison sees the accumulation.
  CHECK(reference_run().losses[1] != ref.losses[1]);
}

TEST_CASE("automatic placement measures the first step and places the rest", "[offload]") {
  offload_options o = base_options();
  o.placement.how = offload_placement::mode::automatic;
  const std::size_t cb = chunk_bytes_of(o);
  SECTION("a large budget keeps everything resident") {
    o.device_bytes = std::size_t{1} << 30;
    offload_trainer t(tiny_gpt(), tiny_train(), o);
    causal_lm_of<gpt> init(tiny_gpt(), batch_dims{2, 16});
    init.init_weights(5);
    t.set_weights(init.slots());
    CHECK(t.measured_non_model_bytes() == 0);
    const double loss = t.step(random_rows).loss;
    INFO("planned " << t.non_model_bytes() << " measured " << t.measured_non_model_bytes());
    CHECK(t.measured_non_model_bytes() >= t.non_model_bytes());
    CHECK_FALSE(t.replaced());
    for (std::int32_t i = 0; i < t.chunk_count(); ++i) {
      CHECK(t.param_home(i) == tier::device);
      CHECK(t.optim_home(i) == tier::device);
    }
    CHECK(loss == reference_run(tiny_train(), 1).losses[0]);
  }
  SECTION("a small budget offloads and trains the same") {
    o.device_bytes = non_model() + 24 * cb;
    offload_trainer t(tiny_gpt(), tiny_train(), o);
    t.step(random_rows);
    int resident = 0;
    for (std::int32_t i = 0; i < t.chunk_count(); ++i) resident += t.param_home(i) == tier::device;
    INFO("chunks " << t.chunk_count() << " resident " << resident);
    CHECK(resident < t.chunk_count());
    require_same(reference_run(), offloaded_run(o));
  }
  SECTION("memory the first step uses beyond the plan moves chunks off the device") {
    // The step allocates nothing beyond its arenas, so the measurement equals the plan:
    o.device_bytes = std::size_t{1} << 30;
    offload_trainer probe(tiny_gpt(), tiny_train(), o);
    probe.step(random_rows);
    CHECK(probe.measured_non_model_bytes() == probe.non_model_bytes());
    // ... unless something else does during it: here the batch source of the first step holds
    // 8 chunks' worth of host memory (as a data loader's buffer would).
    o.device_bytes = non_model() + 24 * cb;
    offload_trainer t(tiny_gpt(), tiny_train(), o);
    causal_lm_of<gpt> init(tiny_gpt(), batch_dims{2, 16});
    init.init_weights(5);
    t.set_weights(init.slots());
    auto greedy = [&](std::uint64_t draw, int b, int n, std::vector<std::int32_t>& rows) {
      memory::buffer held;
      if (draw == 0) held = memory::buffer::host(8 * cb);
      random_rows(draw, b, n, rows);
    };
    int before = 0, after = 0;
    for (std::int32_t i = 0; i < t.chunk_count(); ++i) before += t.param_home(i) == tier::device;
    outcome got;
    for (int s = 0; s < steps; ++s) got.losses.push_back(t.step(greedy).loss);
    for (std::int32_t i = 0; i < t.chunk_count(); ++i) after += t.param_home(i) == tier::device;
    INFO("measured " << t.measured_non_model_bytes() << " resident " << before << " -> " << after);
    CHECK(t.measured_non_model_bytes() >= t.non_model_bytes() + 8 * cb);
    CHECK(t.replaced());
    CHECK(after < before);
    got.weights = weights_of(t);
    require_same(reference_run(), got);  // the move kept every value
  }
}

namespace {

hf::gpt2_config tiny_hf() {
  return {.vocab_size = 64, .n_positions = 16, .n_embd = 32, .n_layer = 3, .n_head = 4};
}

offload_options on_nvme(const std::filesystem::path& dir) {
  offload_options o = base_options();
  o.placement = {
      .param_fraction = 1, .optim_fraction = 1, .param_tier = tier::nvme, .optim_tier = tier::nvme};
  o.nvme_dir = dir.string();
  o.device_bytes = tight_device(o, 2);
  o.host_bytes = 6 * chunk_bytes_of(o);
  return o;
}

}  // namespace

TEST_CASE("a full nvme tier stops training with the store's path", "[offload]") {
  auto dir = std::filesystem::temp_directory_path() / "troupe_offload_test_full";
  std::filesystem::remove_all(dir);
  offload_options o = on_nvme(dir);
  o.nvme_capacity_bytes = 8 * chunk_bytes_of(o);  // far less than the model state
  std::string what;
  {
    offload_trainer off(tiny_gpt(), tiny_train(), o);
    causal_lm_of<gpt> init(tiny_gpt(), batch_dims{2, 16});
    init.init_weights(5);
    try {
      off.set_weights(init.slots());
      for (int s = 0; s < steps; ++s) off.step(random_rows);
    } catch (const troupe::error& e) {
      what = e.what();
    }
  }  // and it closes cleanly after the failure
  INFO(what);
  CHECK_THAT(what, Catch::Contains(dir.string()) && Catch::Contains("capacity"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("an nvme failure in a later step leaves the last checkpoint intact", "[offload]") {
  auto dir = std::filesystem::temp_directory_path() / "troupe_offload_test_fail";
  auto ckpt = std::filesystem::temp_directory_path() / "troupe_offload_test_ckpt";
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(ckpt);
  const hf::model_config mcfg = tiny_hf();
  REQUIRE(hf::to_gpt_config(tiny_hf()).n_layer == tiny_gpt().n_layer);
  std::string what;
  {
    offload_trainer off(tiny_gpt(), tiny_train(), on_nvme(dir));
    causal_lm_of<gpt> staging(tiny_gpt(), batch_dims{1, 16});
    staging.init_weights(5);
    off.set_weights(staging.slots());
    const std::string pages = off.tiers().nvme_path();
    // The batch source of step 3 takes the NVMe tier's data away (the file is cut to nothing):
    // the pages read back after it are gone, as on a failing device.
    auto failing = [&](std::uint64_t draw, int b, int t, std::vector<std::int32_t>& rows) {
      if (draw == 2) std::filesystem::resize_file(pages, 0);
      random_rows(draw, b, t, rows);
    };
    try {
      for (int s = 0; s < steps; ++s) {
        off.step(failing);
        if (off.steps_done() % 2 == 0) off.save(ckpt, mcfg, staging).value();  // every 2 steps
      }
    } catch (const troupe::error& e) {
      what = e.what();
    }
    CHECK(off.steps_done() == 2);
    CHECK_THAT(what, Catch::Contains(pages));
  }
  // The checkpoint of step 2 loads and equals the plain trainer after 2 steps: weights and moments.
  std::vector<float> moments;
  const outcome ref = reference_run(tiny_train(), 2, &moments);
  causal_lm_of<gpt> back(tiny_gpt(), batch_dims{1, 16});
  hf::load_weights(ckpt, mcfg, back.slots()).value();
  CHECK(values(back.memory().params()) == ref.weights);
  const std::int64_t n = back.memory().params().numel();
  owned_tensor m = empty({n}, dtype::f32), v = empty({n}, dtype::f32);
  auto st = hf::load_training_state(ckpt, m, v);
  REQUIRE(st.has_value());
  CHECK(st->step == 2);
  CHECK(std::memcmp(m.data(), moments.data(), n * 4) == 0);
  CHECK(std::memcmp(v.data(), moments.data() + n, n * 4) == 0);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(ckpt);
}

TEST_CASE("an offloaded checkpoint resumes in the plain trainer and in the offloaded one",
          "[offload]") {
  auto ckpt = std::filesystem::temp_directory_path() / "troupe_offload_test_resume";
  std::filesystem::remove_all(ckpt);
  const hf::model_config mcfg = tiny_hf();
  offload_options o = base_options();
  o.placement = {.param_fraction = 1, .optim_fraction = 1};
  o.device_bytes = tight_device(o, 2);
  causal_lm_of<gpt> staging(tiny_gpt(), batch_dims{1, 16});
  {
    offload_trainer off(tiny_gpt(), tiny_train(), o);
    staging.init_weights(5);
    off.set_weights(staging.slots());
    for (int s = 0; s < 2; ++s) off.step(random_rows);
    off.save(ckpt, mcfg, staging).value();
  }
  const outcome ref = reference_run();  // 4 steps without a break
  causal_lm_of<gpt> plain(tiny_gpt(), batch_dims{2, 16});
  trainer tr(plain, tiny_train());
  REQUIRE(tr.resume(ckpt, mcfg).value() == 2);
  offload_trainer again(tiny_gpt(), tiny_train(), o);
  REQUIRE(again.resume(ckpt, mcfg, staging).value() == 2);
  for (int s = 2; s < steps; ++s) {
    const double a = tr.step(random_rows).loss, b = again.step(random_rows).loss;
    CHECK(a == ref.losses[s]);
    CHECK(b == ref.losses[s]);
  }
  std::filesystem::remove_all(ckpt);
}
