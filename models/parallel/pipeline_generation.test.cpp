// Generation through pipeline stages (pipeline_generation.hpp): a tiny GPT-2 and a tiny Llama with
// grouped-query attention cut into stages (threads of a local world: rank = stage * tp + tensor
// rank), alone and as tensor shards with sequence parallelism, against the unsharded model: greedy
// tokens and every step's logits, and what a stage refuses.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/generation.hpp"
#include "models/parallel/gpt_stage.hpp"
#include "models/parallel/llama_stage.hpp"
#include "models/parallel/moe_stage.hpp"
#include "models/parallel/pipeline_generation.hpp"
#include "models/parallel/testing.hpp"
#include "models/sampling.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
using namespace troupe::models::testing;

namespace {

// As in tp_generation.test.cpp: max_seq 16 planned for [2, 8], so with SP over 2 shards a pass
// holds 4 positions and the prompt of 6 runs as two.
constexpr batch_dims dims{2, 8};

gpt_config tiny_gpt() {
  return gpt_shape(/*vocab=*/32, /*max_seq=*/16, /*dim=*/32, /*n_layer=*/4, /*n_head=*/4);
}

llama_config tiny_llama(bool tied) {
  llama_config c;
  c.vocab = 32;
  c.max_seq = 16;
  c.dim = 32;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.hidden = 48;
  c.tie_embeddings = tied;
  return c;
}

// A Mixtral-like MoE model (4 experts, top 2, grouped-query attention) with Qwen2-MoE's shared
// expert when `shared`.
moe_config tiny_moe(bool shared) {
  moe_config c;
  c.vocab = 32;
  c.max_seq = 16;
  c.dim = 32;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.expert_hidden = 24;
  c.n_expert = 4;
  c.top_k = 2;
  c.shared_hidden = shared ? 40 : 0;
  c.norm_topk_prob = !shared;
  c.aux_loss = true;
  return c;
}

// The pp and tp communicators of a pp x tp local world (rank = stage * tp + tensor rank).
struct grid_comms {
  std::vector<std::unique_ptr<collective::communicator>> pp, tp;
  std::vector<collective::communicator*> all;
};

grid_comms make_grid(int pp, int tp) {
  const int n = pp * tp;
  auto world = std::make_shared<collective::local_world>(n);
  collective::rank_grid grid({{"pp", pp}, {"tp", tp}});
  grid_comms g;
  g.pp.resize(n);
  g.tp.resize(n);
  for (int r = 0; r < n; ++r) {
    g.pp[r] = collective::make_communicator(world->transport(r), grid.group(r, {"pp"}), "local:pp",
                                            world);
    g.all.push_back(g.pp[r].get());
    if (tp == 1) continue;
    g.tp[r] = collective::make_communicator(world->transport(r), grid.group(r, {"tp"}), "local:tp",
                                            world);
    g.all.push_back(g.tp[r].get());
  }
  return g;
}

// Runs steps (each i32 [B, t]) from an empty cache of `batch` sequences and returns each step's
// logits [B, V], flattened.
template <class Model>
std::vector<std::vector<double>> step_all(Model& m, std::int64_t batch,
                                          const std::vector<owned_tensor>& steps) {
  m.begin_generation(batch, 0);
  std::vector<std::vector<double>> out;
  for (const auto& ids : steps) out.push_back(as_f64(m.step_logits(ids)));
  return out;
}

owned_tensor row(const std::int32_t* p, std::int64_t n) {
  owned_tensor t = empty({1, n}, dtype::i32);
  std::copy(p, p + n, t.data_as<std::int32_t>());
  return t;
}

std::int32_t argmax(const tensor& logits) {
  const float* p = logits.data_as<float>();
  return static_cast<std::int32_t>(std::max_element(p, p + logits.numel()) - p);
}

// What generate() does with a greedy sampler, on anything with begin_generation / step_logits
// (the pipeline generator is not a causal_lm): the prompt as one step, then each token chosen.
template <class Model>
std::vector<std::int32_t> greedy(Model& m, const std::vector<std::int32_t>& prompt,
                                 std::int64_t total) {
  m.begin_generation(1, total);
  std::vector<std::int32_t> out;
  std::int32_t next = argmax(m.step_logits(row(prompt.data(), std::ssize(prompt))));
  for (;;) {
    out.push_back(next);
    if (std::ssize(prompt) + std::ssize(out) >= total) return out;
    next = argmax(m.step_logits(row(&next, 1)));
  }
}

// Greedy generation through the stages of `plan` (Stage(cfg, dims, options, tp group) holding the
// slices of an unsharded model of cfg after init_weights(5)): on every rank the unsharded model's
// generate() tokens, and every step's logits (the prompt, then each token) as accurate as the
// unsharded model's against its f64 twin (tests/rounding.hpp), as tp_generation.test.cpp judges
// the tensor shards alone.
template <class Whole, class Stage, class Config>
void check_pipeline(const Config& cfg, const scheduler::parallel_plan& plan) {
  const std::vector<std::int32_t> prompt = {3, 14, 15, 9, 2, 6};
  const std::int64_t total = cfg.max_seq;
  causal_lm_of<Whole> whole(cfg, dims);
  whole.init_weights(5);
  auto exact = f64_twin(whole.model(), dims);
  token_sampler g({.greedy = true});
  const std::vector<std::int32_t> want = generate(whole, prompt, total, g);
  REQUIRE(std::ssize(want) == total - std::ssize(prompt));
  std::vector<owned_tensor> steps;
  steps.push_back(row(prompt.data(), std::ssize(prompt)));
  for (std::size_t i = 0; i + 1 < want.size(); ++i) steps.push_back(row(&want[i], 1));
  const auto ref = step_all(whole.model(), 1, steps);
  const auto x = step_all(*exact, 1, steps);

  const int n = plan.pp * plan.tp;
  grid_comms comms = make_grid(plan.pp, plan.tp);
  std::vector<std::vector<std::int32_t>> got(n);
  std::vector<std::vector<std::vector<double>>> logits(n);
  run_threads(
      n,
      [&](int r) {
        const int s = r / plan.tp;
        Stage stage(cfg, dims, stage_options::of(plan, s), tp_group{comms.tp[r].get(), plan.sp});
        stage.load_from(whole.model().slots());
        pipeline_generator gen(stage, *comms.pp[r], cfg.dim);
        got[r] = greedy(gen, prompt, total);
        logits[r] = step_all(gen, 1, steps);
      },
      comms.all);
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r);
    CHECK(got[r] == want);
    REQUIRE(logits[r].size() == steps.size());
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const auto v = tests::as_accurate_as(logits[r][i], ref[i], x[i]);
      INFO("step " << i << ": " << v.str());
      CHECK(v.ok());
    }
  }
}

scheduler::parallel_plan plan_of(int pp, int virtual_stages, int tp, bool sp) {
  scheduler::parallel_plan p;
  p.pp = pp;
  p.virtual_stages = virtual_stages;
  p.tp = tp;
  p.sp = sp;
  return p;
}

}  // namespace

TEST_CASE("Greedy generation through GPT-2 pipeline stages gives the single process's tokens",
          "[parallel]") {
  // Two stages; four virtual stages on two ranks; two chunks on one rank; two stages of tp2 x SP.
  for (const auto& p : {plan_of(2, 1, 1, false), plan_of(2, 2, 1, false), plan_of(1, 2, 1, false),
                        plan_of(2, 1, 2, true)}) {
    INFO("pp " << p.pp << " virtual stages " << p.virtual_stages << " tp " << p.tp << " sp "
               << p.sp);
    check_pipeline<gpt, gpt_stage>(tiny_gpt(), p);
  }
}

TEST_CASE("Greedy generation through Llama pipeline stages gives the single process's tokens",
          "[parallel]") {
  // Tied: the last stage's copy of embed_tokens is the head.
  for (bool tied : {false, true})
    for (const auto& p :
         {plan_of(2, 1, 1, false), plan_of(2, 1, 2, false), plan_of(2, 2, 2, true)}) {
      INFO("tied " << tied << " pp " << p.pp << " virtual stages " << p.virtual_stages << " tp "
                   << p.tp << " sp " << p.sp);
      check_pipeline<llama, llama_stage>(tiny_llama(tied), p);
    }
}

TEST_CASE("A pipeline stage refuses generation steps before begin_generation", "[parallel]") {
  using Catch::Matchers::Contains;
  auto comms = collective::make_local_group(1);
  gpt_stage stage(tiny_gpt(), dims, stage_options::of(plan_of(1, 2, 1, false), 0));
  pipeline_generator gen(stage, *comms[0], tiny_gpt().dim);
  owned_tensor one = zeros({1, 1}, dtype::i32);
  CHECK_THROWS_WITH(gen.step_logits(one), Contains("gpt_stage: a generation step before"));
  CHECK_THROWS_WITH(gen.begin_generation(3), Contains("generation batch 3 must be in 1..2"));
  gen.begin_generation(1, 1);
  gen.step_logits(one);
  CHECK_THROWS_WITH(gen.step_logits(one), Contains("exceed the cache capacity 1"));
  CHECK(gen.generated_length() == 1);
}

// The MoE family's stages (moe_stage.hpp): generation runs the same step_chunk through each
// stage's attention and MoE layers (no router statistics travel: no loss).
TEST_CASE("Greedy generation through MoE pipeline stages gives the single process's tokens",
          "[parallel][moe]") {
  for (bool shared : {false, true})
    for (const auto& p : {plan_of(2, 1, 1, false), plan_of(2, 2, 1, false)}) {
      INFO("shared expert " << shared << " pp " << p.pp << " virtual stages " << p.virtual_stages);
      check_pipeline<moe, moe_stage>(tiny_moe(shared), p);
    }
}
