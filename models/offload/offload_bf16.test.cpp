// bf16 under memory tiers: the offloaded trainer keeps f32 master weights, gradients and moments in
// its chunks and computes each unit in bf16 from the master weights rounded when the unit runs,
// so that a GPT-2 or a Llama (gradient accumulation, recompute, tied heads) trains as the plain
// bf16 trainer (models/trainer.hpp) trains it, bit for bit, and each resumes the other's
// checkpoint. The models' widths are no multiples of 32 elements, so the bf16 layout of the
// moments (trainer's) differs from the f32 one.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/offload/offload_trainer.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;
using memory::tier;
namespace fs = std::filesystem;

namespace {

constexpr int steps = 4;
constexpr std::int64_t vocab = 50;

hf::model_config tiny_gpt2() {
  hf::gpt2_config g;
  g.vocab_size = vocab;
  g.n_positions = 16;
  g.n_embd = 24;  // c_attn's bias (72) and the MLP's (96) pad differently in bf16 and f32
  g.n_layer = 3;
  g.n_head = 3;
  return g;
}

hf::model_config tiny_llama(bool tied) {
  hf::llama_config h;
  h.vocab_size = vocab;
  h.hidden_size = 24;
  h.intermediate_size = 40;
  h.num_hidden_layers = 3;
  h.num_attention_heads = 4;
  h.num_key_value_heads = 2;  // grouped-query heads
  h.head_dim = 6;
  h.max_position_embeddings = 16;
  h.tie_word_embeddings = tied;
  h.mlp_bias = true;  // biases of 40 elements
  return h;
}

train_config bf16_train(std::int64_t grad_accum = 1, bool recompute = false) {
  train_config c;
  c.batch = 2;
  c.seq = 16;
  c.steps = 20;
  c.warmup = 2;
  c.lr = 1e-2;
  c.clip = 0.5;  // small enough that clipping acts
  c.decay_exempt = true;
  c.grad_accum = grad_accum;
  c.recompute = recompute;
  c.precision = "bf16";
  return c;
}

void random_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  std::mt19937_64 gen(2000 + draw);
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (auto& r : rows) r = static_cast<std::int32_t>(gen() % vocab);
}

std::unique_ptr<causal_lm> bf16_model(const hf::model_config& m, const train_config& c) {
  return make_causal_lm(m, {c.batch, c.seq}, dtype::bf16, device::cpu(),
                        {.recompute = c.recompute});
}

struct outcome {
  std::vector<double> losses;
  std::vector<float> master;  // every parameter's master weights, in slot order, no padding
  bool clipped = false;
};

std::vector<float> values(const tensor& t) {
  const auto* p = static_cast<const float*>(t.data());
  return {p, p + t.numel()};
}

// The plain trainer's master weights (laid out as its bf16 model's parameters).
std::vector<float> master_of(const trainer& tr, const slot_list& slots) {
  const param_placement lay = place_params(slots, dtype::bf16);
  std::vector<float> out;
  std::size_t k = 0;
  for (const auto& s : slots.slots()) {
    if (s.kind != slot_kind::param) continue;
    const auto v = values(tr.master_weights().narrow(0, lay.offsets[k++], s.sizes.numel()));
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

std::vector<float> master_of(offload_trainer& off, const hf::model_config& m) {
  auto f32 = make_causal_lm(m, {1, 16});
  off.copy_weights_to(f32->slots());
  std::vector<float> out;
  for (const auto& s : f32->slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    const auto v = values(*s.field);
    out.insert(out.end(), v.begin(), v.end());
  }
  return out;
}

// Parameters and optimizer state on the host; the device holds the non-model memory (the bf16
// working copies included) and two chunk slots beyond what a step pins.
offload_options paged(const hf::model_config& m, const train_config& cfg) {
  offload_options o;
  o.chunk_candidates = {16384};  // small chunks, so that this small model spans several
  o.device_bytes = std::size_t{1} << 30;
  o.placement = {.param_fraction = 1, .optim_fraction = 1};
  offload_trainer probe(m, cfg, o);
  o.device_bytes = probe.non_model_bytes() +
                   (probe.pinned_at_once(tier::device) + 2) * probe.chunking().layout.chunk_bytes;
  return o;
}

outcome plain_run(const hf::model_config& m, const train_config& cfg) {
  auto model = bf16_model(m, cfg);
  model->init_weights(5);
  trainer tr(*model, cfg);
  outcome o;
  for (int s = 0; s < steps; ++s) {
    const auto r = tr.step(random_rows);
    o.losses.push_back(r.loss);
    o.clipped = o.clipped || r.grad_norm > cfg.clip;
  }
  o.master = master_of(tr, model->slots());
  return o;
}

outcome offloaded_run(const hf::model_config& m, const train_config& cfg,
                      memory::tier_report& rep) {
  offload_trainer off(m, cfg, paged(m, cfg));
  auto init = bf16_model(m, cfg);  // the plain trainer's starting point: the bf16 model's values
  init->init_weights(5);
  off.set_weights(init->slots());
  outcome o;
  for (int s = 0; s < steps; ++s) o.losses.push_back(off.step(random_rows).loss);
  rep = off.tiers().report();
  o.master = master_of(off, m);
  return o;
}

void require_same(const outcome& ref, const outcome& got, int from = 0) {
  REQUIRE(got.losses.size() == static_cast<std::size_t>(steps - from));
  for (int i = from; i < steps; ++i) {
    INFO("step " << i + 1 << ": " << ref.losses[i] << " vs " << got.losses[i - from]);
    CHECK(ref.losses[i] == got.losses[i - from]);
  }
  REQUIRE(ref.master.size() == got.master.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < ref.master.size(); ++i) differ += ref.master[i] != got.master[i];
  // Bit for bit: the same bf16 kernels run in the same order on the same values (the master
  // weights rounded once per use, bf16 gradients accumulated in bf16 and carried through f32
  // exactly), and the f32 clipping and AdamW see the same f32 gradients.
  INFO("master weights differing: " << differ << " of " << ref.master.size());
  CHECK(differ == 0);
}

void check_same_as_plain(const hf::model_config& m, const train_config& cfg) {
  const outcome ref = plain_run(m, cfg);
  CHECK(ref.clipped);  // the comparison covers the clipping
  memory::tier_report rep;
  const outcome off = offloaded_run(m, cfg, rep);
  require_same(ref, off);
  CHECK(rep.evictions > 0);  // the master weights were paged, not resident
}

struct temp_folder {
  explicit temp_folder(const std::string& what)
      : path(fs::temp_directory_path() /
             ("troupe_offload_bf16_" + what + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
  }
  ~temp_folder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

}  // namespace

TEST_CASE("bf16 under memory tiers trains as the plain bf16 trainer, bit for bit", "[offload]") {
  SECTION("gpt2") {
    check_same_as_plain(tiny_gpt2(), bf16_train());
  }
  SECTION("gpt2 with gradient accumulation and recompute") {
    check_same_as_plain(tiny_gpt2(), bf16_train(3, true));
  }
  SECTION("llama, untied head") {
    check_same_as_plain(tiny_llama(false), bf16_train());
  }
  SECTION("llama, tied head (the back reads the front's embed_tokens), gradient accumulation") {
    check_same_as_plain(tiny_llama(true), bf16_train(2));
  }
  SECTION("llama with recompute and gradient accumulation") {
    check_same_as_plain(tiny_llama(false), bf16_train(2, true));
  }
}

TEST_CASE("bf16 under memory tiers keeps the compute copy out of the chunks", "[offload]") {
  const auto m = tiny_llama(false);
  train_config f32 = bf16_train();
  f32.precision = "f32";
  offload_options o;
  o.chunk_candidates = {16384};
  o.device_bytes = std::size_t{1} << 30;
  offload_trainer a(m, f32, o), b(m, bf16_train(), o);
  // The chunks hold f32 master weights, gradients and moments in either precision.
  CHECK(a.model_state_bytes() == b.model_state_bytes());
  CHECK(a.chunk_count() == b.chunk_count());
  // The bf16 activations take half the bytes; the working copies of one unit come on top.
  CHECK(b.non_model_bytes() < a.non_model_bytes());
}

TEST_CASE("a bf16 run under memory tiers and the plain bf16 trainer resume each other",
          "[offload]") {
  const auto m = tiny_gpt2();
  const train_config cfg = bf16_train(2);
  const outcome ref = plain_run(m, cfg);  // 4 steps without a break
  const offload_options o = paged(m, cfg);
  auto staging = make_causal_lm(m, {1, 16});  // f32: it carries the master weights

  SECTION("the plain trainer's checkpoint, resumed under memory tiers") {
    temp_folder ckpt("plain");
    {
      auto model = bf16_model(m, cfg);
      model->init_weights(5);
      trainer tr(*model, cfg);
      for (int s = 0; s < 2; ++s) tr.step(random_rows);
      REQUIRE(tr.save(ckpt.path, m).has_value());
    }
    offload_trainer off(m, cfg, o);
    REQUIRE(off.resume(ckpt.path, m, *staging).value() == 2);
    outcome got;
    for (int s = 2; s < steps; ++s) got.losses.push_back(off.step(random_rows).loss);
    got.master = master_of(off, m);
    require_same(ref, got, 2);
  }
  SECTION("the tiers' checkpoint, resumed by the plain trainer") {
    temp_folder ckpt("tiers");
    {
      offload_trainer off(m, cfg, o);
      auto init = bf16_model(m, cfg);
      init->init_weights(5);
      off.set_weights(init->slots());
      for (int s = 0; s < 2; ++s) off.step(random_rows);
      REQUIRE(off.save(ckpt.path, m, *staging).has_value());
    }
    auto model = bf16_model(m, cfg);
    trainer tr(*model, cfg);
    REQUIRE(tr.resume(ckpt.path, m).value() == 2);
    outcome got;
    for (int s = 2; s < steps; ++s) got.losses.push_back(tr.step(random_rows).loss);
    got.master = master_of(tr, model->slots());
    require_same(ref, got, 2);
  }
}

TEST_CASE("the offloaded trainer refuses f16 and a 16-bit staging model, naming them",
          "[offload][faults]") {
  const auto m = tiny_gpt2();
  offload_options o;
  o.device_bytes = std::size_t{1} << 30;
  train_config f16 = bf16_train();
  f16.precision = "f16";
  try {
    offload_trainer off(m, f16, o);
    FAIL("f16 was accepted");
  } catch (const error& e) {
    std::cout << "faults: offload_trainer with precision f16 -> refused: " << e.what() << "\n";
    CHECK_THAT(e.what(), Catch::Contains("precision f16") && Catch::Contains("f32 or bf16"));
  }
  offload_trainer off(m, bf16_train(), o);
  auto staging = make_causal_lm(m, {1, 16}, dtype::bf16);
  temp_folder ckpt("staging");
  try {
    (void)off.save(ckpt.path, m, *staging);
    FAIL("a bf16 staging model was accepted");
  } catch (const error& e) {
    std::cout << "faults: offload_trainer::save through a bf16 staging model -> refused: "
              << e.what() << "\n";
    CHECK_THAT(e.what(), Catch::Contains("staging model") && Catch::Contains("bf16"));
  }
}
