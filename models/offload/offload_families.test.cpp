// The offloaded trainer runs every family's trunk in the streamed placement: a Llama (untied and
// tied head, grouped-query heads) and per-block recompute (GPT-2 and Llama) train under memory
// tiers as models/trainer.hpp trains them unconstrained, bit for bit.
#include <catch2/catch.hpp>

#include <random>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/llama.hpp"
#include "models/offload/offload_trainer.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;
using memory::tier;

namespace {

constexpr int steps = 4;

llama_config tiny_llama(bool tied = false, bool recompute = false) {
  return {.vocab = 64,
          .dim = 32,
          .n_layer = 3,
          .n_head = 4,
          .n_kv_head = 2,
          .hidden = 48,
          .max_seq = 16,
          .tie_embeddings = tied,
          .recompute = recompute};
}

gpt_config tiny_gpt(bool recompute) {
  return {.vocab = 64, .max_seq = 16, .dim = 32, .n_layer = 3, .n_head = 4, .recompute = recompute};
}

train_config tiny_train(std::int64_t grad_accum = 1) {
  train_config c;
  c.batch = 2;
  c.seq = 16;
  c.steps = 20;
  c.warmup = 2;
  c.lr = 1e-2;
  c.clip = 0.5;  // small enough that clipping acts
  c.decay_exempt = true;
  c.grad_accum = grad_accum;
  return c;
}

void random_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  std::mt19937_64 gen(1000 + draw);
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (auto& r : rows) r = static_cast<std::int32_t>(gen() % 64);
}

struct outcome {
  std::vector<double> losses;
  std::vector<float> weights;  // the model's flat parameter buffer
  bool clipped = false;
};

std::vector<float> values(const tensor& t) {
  return {static_cast<const float*>(t.data()), static_cast<const float*>(t.data()) + t.numel()};
}

outcome plain_run(causal_lm& m, const train_config& cfg) {
  m.init_weights(5);
  trainer tr(m, cfg);
  outcome o;
  for (int s = 0; s < steps; ++s) {
    const auto r = tr.step(random_rows);
    o.losses.push_back(r.loss);
    o.clipped = o.clipped || r.grad_norm > cfg.clip;
  }
  o.weights = values(m.memory().params());
  return o;
}

offload_options small_chunks() {
  offload_options o;
  o.chunk_candidates = {16384};  // small chunks, so that this small model spans many
  o.device_bytes = std::size_t{1} << 30;
  return o;
}

// Parameters and optimizer state on the host; the device holds the non-model memory and two
// chunk slots beyond what a step pins.
template <class Config>
offload_options paged(const Config& model, const train_config& cfg) {
  offload_options o = small_chunks();
  o.placement = {.param_fraction = 1, .optim_fraction = 1};
  offload_trainer probe(model, cfg, o);
  o.device_bytes = probe.non_model_bytes() +
                   (probe.pinned_at_once(tier::device) + 2) * probe.chunking().layout.chunk_bytes;
  return o;
}

// `init` gives the initial weights and receives the trained ones.
template <class Config>
outcome offloaded_run(const Config& model, causal_lm& init, const train_config& cfg,
                      memory::tier_report& rep) {
  offload_trainer off(model, cfg, paged(model, cfg));
  init.init_weights(5);
  off.set_weights(init.slots());
  outcome o;
  for (int s = 0; s < steps; ++s) o.losses.push_back(off.step(random_rows).loss);
  rep = off.tiers().report();
  off.copy_weights_to(init.slots());
  o.weights = values(init.memory().params());
  return o;
}

void require_same(const outcome& ref, const outcome& off) {
  CHECK(ref.clipped);  // the comparison covers the clipping
  REQUIRE(ref.losses.size() == off.losses.size());
  for (std::size_t i = 0; i < ref.losses.size(); ++i) {
    INFO("step " << i << ": " << ref.losses[i] << " vs " << off.losses[i]);
    CHECK(ref.losses[i] == off.losses[i]);
  }
  REQUIRE(ref.weights.size() == off.weights.size());
  std::size_t differ = 0;
  for (std::size_t i = 0; i < ref.weights.size(); ++i) differ += ref.weights[i] != off.weights[i];
  // Bit for bit: paging moves bytes and does no arithmetic; the same kernels run in the same
  // order on the same values.
  INFO("weights differing: " << differ << " of " << ref.weights.size());
  CHECK(differ == 0);
}

template <class Model, class Config>
void check_offloaded_equals_plain(const Config& model, const train_config& cfg) {
  causal_lm_of<Model> plain(model, batch_dims{2, 16});
  const outcome ref = plain_run(plain, cfg);
  causal_lm_of<Model> init(model, batch_dims{2, 16});
  memory::tier_report rep;
  const outcome off = offloaded_run(model, init, cfg, rep);
  require_same(ref, off);
  CHECK(rep.evictions > 0);  // the parameters were paged, not resident
}

}  // namespace

TEST_CASE("a Llama trained under memory tiers equals its plain run", "[offload]") {
  SECTION("untied head, grouped-query heads") {
    check_offloaded_equals_plain<llama>(tiny_llama(), tiny_train());
  }
  SECTION("tied head: the back reads the front's embed_tokens") {
    check_offloaded_equals_plain<llama>(tiny_llama(true), tiny_train());
  }
  SECTION("gradient accumulation") {
    check_offloaded_equals_plain<llama>(tiny_llama(), tiny_train(3));
  }
}

TEST_CASE("recompute under memory tiers equals the plain recomputed run", "[offload]") {
  SECTION("gpt") {
    check_offloaded_equals_plain<gpt>(tiny_gpt(true), tiny_train());
  }
  SECTION("llama, with gradient accumulation") {
    check_offloaded_equals_plain<llama>(tiny_llama(false, true), tiny_train(2));
  }
  SECTION("the blocks share one set of activation bytes") {
    const auto whole =
        offload_trainer(tiny_llama(), tiny_train(), small_chunks()).non_model_bytes();
    const auto shared =
        offload_trainer(tiny_llama(false, true), tiny_train(), small_chunks()).non_model_bytes();
    CHECK(shared < whole);
  }
}

TEST_CASE("the offloaded trainer built from an HF Llama config trains as the plain trainer",
          "[offload]") {
  hf::llama_config h;
  h.vocab_size = 64;
  h.hidden_size = 32;
  h.intermediate_size = 48;
  h.num_hidden_layers = 2;
  h.num_attention_heads = 4;
  h.num_key_value_heads = 2;
  h.head_dim = 8;
  h.max_position_embeddings = 16;
  const hf::model_config mcfg = h;
  train_config cfg = tiny_train();
  cfg.recompute = true;  // the HF config's model takes train.recompute
  auto plain = make_causal_lm(mcfg, {2, 16}, dtype::f32, device::cpu(), {.recompute = true});
  const outcome ref = plain_run(*plain, cfg);
  auto init = make_causal_lm(mcfg, {2, 16});
  memory::tier_report rep;
  require_same(ref, offloaded_run(mcfg, *init, cfg, rep));
}
