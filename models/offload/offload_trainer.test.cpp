// The offloaded trainer against models/trainer.hpp's unconstrained run on gpt: the same losses and
// weights when the budgets force parameters and optimizer state to the host, to NVMe, or let the
// automatic placement split them.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <random>

#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
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

outcome reference_run() {
  causal_lm_of<gpt> m(tiny_gpt(), batch_dims{2, 16});
  m.init_weights(5);
  trainer tr(m, tiny_train());
  outcome o;
  bool clipped = false;
  for (int s = 0; s < steps; ++s) {
    auto r = tr.step(random_rows);
    o.losses.push_back(r.loss);
    clipped = clipped || r.grad_norm > tiny_train().clip;
  }
  CHECK(clipped);  // the comparison covers the clipping
  const tensor& p = m.memory().params();
  o.weights.assign(static_cast<const float*>(p.data()),
                   static_cast<const float*>(p.data()) + p.numel());
  return o;
}

outcome offloaded_run(const offload_options& opt, memory::tier_report* rep = nullptr,
                      offload_trainer** keep = nullptr) {
  causal_lm_of<gpt> init(tiny_gpt(), batch_dims{2, 16});
  init.init_weights(5);
  offload_trainer off(tiny_gpt(), tiny_train(), opt);
  off.set_weights(init.slots());
  outcome o;
  for (int s = 0; s < steps; ++s) o.losses.push_back(off.step(random_rows).loss);
  if (rep) *rep = off.tiers().report();
  causal_lm_of<gpt> out(tiny_gpt(), batch_dims{2, 16});
  off.copy_weights_to(out.slots());
  const tensor& p = out.memory().params();
  o.weights.assign(static_cast<const float*>(p.data()),
                   static_cast<const float*>(p.data()) + p.numel());
  (void)keep;
  return o;
}

void require_same(const outcome& ref, const outcome& off) {
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
  INFO("weights differing: " << differ << " of " << ref.weights.size() << ", worst " << worst);
  CHECK(worst <= 1e-6);
  CHECK(differ == 0);
  CHECK(ref.losses[steps - 1] < ref.losses[0]);  // it trains
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
