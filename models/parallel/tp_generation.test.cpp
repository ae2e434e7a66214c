// Generation on tensor shards (tp_generation.hpp): a tiny GPT-2 and a tiny Llama with grouped-query
// attention split over 2 (GPT-2 also 4) shards, threads of a local group, with and without
// sequence parallelism, against the unsharded model: greedy tokens through generate(), the logits
// of every step against the unsharded model's and its f64 twin's, a batch of two sequences with
// steps that SP runs in several passes, and what generation refuses.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/generation.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/testing.hpp"
#include "models/sampling.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

// max_seq 16 planned for [2, 8]: with SP over 2 shards a pass holds 4 positions per sequence, so a
// prompt of 6 runs as two passes (4 + 2) and every later step as one.
constexpr batch_dims dims{2, 8};

gpt_config tiny_gpt() {
  return gpt_shape(/*vocab=*/32, /*max_seq=*/16, /*dim=*/32, /*n_layer=*/2, /*n_head=*/4);
}

llama_config tiny_llama(bool tied) {
  llama_config c;
  c.vocab = 32;
  c.max_seq = 16;
  c.dim = 32;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;  // one key/value head per shard at tp 2
  c.hidden = 48;
  c.tie_embeddings = tied;
  return c;
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

// The steps generate() makes for `prompt` and the tokens it chose: the prompt, then every token
// but the last, one at a time.
std::vector<owned_tensor> steps_of(const std::vector<std::int32_t>& prompt,
                                   const std::vector<std::int32_t>& tokens) {
  std::vector<owned_tensor> steps;
  auto row = [&](const std::int32_t* p, std::int64_t n) {
    owned_tensor t = empty({1, n}, dtype::i32);
    std::copy(p, p + n, t.data_as<std::int32_t>());
    steps.push_back(std::move(t));
  };
  row(prompt.data(), std::ssize(prompt));
  for (std::size_t i = 0; i + 1 < tokens.size(); ++i) row(&tokens[i], 1);
  return steps;
}

std::size_t argmax(const std::vector<double>& v) {
  return static_cast<std::size_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// The gap between the largest and the second largest of v.
double top_gap(std::vector<double> v) {
  std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<>());
  return v[0] - v[1];
}

// Greedy generation on tp shards (causal_lm_of<Shard> holding the slices of an unsharded model of
// cfg after init_weights(5)) against the unsharded model's generate(): the same tokens on every
// shard, and every step's logits as accurate as the unsharded model's against its f64 twin
// (tests/rounding.hpp: the shards sum the heads' and the MLP columns' parts in another order; a
// wrong cache, head or position is off by a logit gap, 1e3 times the bound). The equality of the
// tokens is derived, not lucky: at every step the f64 logits' two largest are more than twice the
// bound apart, so neither f32 evaluation can swap them. Then 12 sampled tokens (temperature 1,
// one seed): the same on every shard, whose logits are the same bytes.
template <class Whole, class Shard, class Config>
void check_greedy(const Config& cfg, int tp, bool sp) {
  const std::vector<std::int32_t> prompt = {3, 14, 15, 9, 2, 6};
  const std::int64_t max_new = 10;  // fills max_seq
  causal_lm_of<Whole> whole(cfg, dims);
  whole.init_weights(5);
  auto exact = f64_twin(whole.model(), dims);
  token_sampler greedy({.greedy = true});
  const std::vector<std::int32_t> want = generate(whole, prompt, max_new, greedy);
  REQUIRE(std::ssize(want) == max_new);
  const auto steps = steps_of(prompt, want);
  const auto ref = step_all(whole.model(), 1, steps);
  const auto x = step_all(*exact, 1, steps);

  std::vector<std::vector<std::int32_t>> got(tp), sampled(tp);
  std::vector<std::vector<std::vector<double>>> logits(tp);
  run_ranks(tp, [&](int r, collective::communicator& comm) {
    causal_lm_of<Shard> shard(cfg, dims, tp_group{&comm, sp});
    shard.model().load_from(whole.model().slots());
    token_sampler g({.greedy = true});
    got[r] = generate(shard, prompt, max_new, g);
    logits[r] = step_all(shard.model(), 1, steps);  // the same cache, emptied
    token_sampler s({.temperature = 1.0}, /*seed=*/11);
    sampled[r] = generate(shard, prompt, 12, s);
  });
  for (int r = 0; r < tp; ++r) {
    INFO("rank " << r);
    CHECK(got[r] == want);
    CHECK(sampled[r] == sampled[0]);
    REQUIRE(logits[r].size() == steps.size());
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const auto v = tests::as_accurate_as(logits[r][i], ref[i], x[i]);
      INFO("step " << i << ": " << v.str() << "; f64 top-two gap " << top_gap(x[i]));
      CHECK(v.ok());
      CHECK(argmax(x[i]) == static_cast<std::size_t>(want[i]));
      CHECK(top_gap(x[i]) > 2 * v.bound);
    }
  }
}

// Two sequences at once through step_logits: a prompt of 6 per sequence (with SP two passes whose
// ids are copied out of the strided step), three single tokens, then a step of 5 (with SP 4 + 1,
// the second pass starting at position 13). Every step's [2, V] logits as accurate as the
// unsharded model's against its f64 twin, and a shard built with activation recompute (its
// blocks sharing one set of activation bytes) gives the same logits bit for bit.
template <class Whole, class Shard, class Config>
void check_batch_steps(const Config& cfg, bool sp) {
  Whole whole(cfg, dims);
  whole.init_weights(8);
  auto exact = f64_twin(whole, dims);
  std::vector<owned_tensor> steps;
  std::int32_t next = 1;
  for (std::int64_t t : {6, 1, 1, 1, 5}) {
    owned_tensor ids = empty({2, t}, dtype::i32);
    for (std::int64_t i = 0; i < ids.numel(); ++i)
      ids.data_as<std::int32_t>()[i] = (next += 7) % static_cast<std::int32_t>(cfg.vocab);
    steps.push_back(std::move(ids));
  }
  const auto ref = step_all(whole, 2, steps);
  const auto x = step_all(*exact, 2, steps);
  std::vector<std::vector<std::vector<double>>> logits(2), recomputed(2);
  std::vector<std::int64_t> length(2);
  run_ranks(2, [&](int r, collective::communicator& comm) {
    Shard shard(cfg, dims, tp_group{&comm, sp});
    shard.load_from(whole.slots());
    logits[r] = step_all(shard, 2, steps);
    length[r] = shard.generated_length();
    Config c = cfg;
    c.recompute = true;
    Shard other(c, dims, tp_group{&comm, sp});
    other.load_from(whole.slots());
    recomputed[r] = step_all(other, 2, steps);
  });
  for (int r = 0; r < 2; ++r) {
    INFO("rank " << r);
    CHECK(length[r] == 14);
    CHECK(recomputed[r] == logits[r]);
    for (std::size_t i = 0; i < steps.size(); ++i) {
      const auto v = tests::as_accurate_as(logits[r][i], ref[i], x[i]);
      INFO("step " << i << ": " << v.str());
      CHECK(v.ok());
    }
  }
}

}  // namespace

TEST_CASE("Greedy generation on GPT-2 tensor shards gives the single process's tokens",
          "[parallel]") {
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      check_greedy<gpt, tp_gpt>(tiny_gpt(), tp, sp);
    }
}

TEST_CASE("Greedy generation on Llama tensor shards with GQA gives the single process's tokens",
          "[parallel]") {
  for (bool tied : {false, true})
    for (bool sp : {false, true}) {
      INFO("tied " << tied << " sp " << sp);
      check_greedy<llama, tp_llama>(tiny_llama(tied), 2, sp);
    }
}

TEST_CASE(
    "Tensor shards generate two sequences at once as the single process does, in passes under SP",
    "[parallel]") {
  for (bool sp : {false, true}) {
    INFO("sp " << sp);
    check_batch_steps<gpt, tp_gpt>(tiny_gpt(), sp);
    check_batch_steps<llama, tp_llama>(tiny_llama(false), sp);
  }
}

TEST_CASE("Tensor shards refuse generation steps that do not fit, naming the model", "[parallel]") {
  using Catch::Matchers::Contains;
  run_ranks(2, [&](int, collective::communicator& comm) {
    tp_gpt m(tiny_gpt(), dims, tp_group{&comm, true});
    owned_tensor one = zeros({1, 1}, dtype::i32), long_step = zeros({1, 9}, dtype::i32);
    // Refused before any collective, alike on both shards.
    CHECK_THROWS_WITH(m.step_logits(one), Contains("tp_gpt: step_logits called before"));
    CHECK_THROWS_WITH(m.begin_generation(3, 0), Contains("generation batch 3 must be in 1..2"));
    CHECK_THROWS_WITH(m.begin_generation(1, 17), Contains("capacity 17 must be in 1..16"));
    m.begin_generation(1, 2);
    CHECK_THROWS_WITH(m.step_logits(long_step), Contains("exceeds the generation batch"));
    m.step_logits(one);
    m.step_logits(one);
    CHECK_THROWS_WITH(m.step_logits(one), Contains("exceed the cache capacity 2"));
    CHECK(m.generated_length() == 2);
  });
}
