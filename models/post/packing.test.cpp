// Packed rows on the trunk: a row holding several sequences (segment ids, positions restarting
// per sequence) gives the loss and gradients of running each sequence alone, for GPT-2 (learned
// positions) and Llama (RoPE, grouped-query attention), judged by tests/rounding.hpp against the
// f64 twin of the separate runs.
#include <catch2/catch.hpp>

#include <cstring>
#include <vector>

#include "models/gpt.hpp"
#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

constexpr std::int64_t seq = 24;
const std::vector<std::int64_t> lengths{5, 9, 7};  // 21 tokens and 3 of padding

struct packed_batch {
  owned_tensor ids, targets, segments, positions;      // [1, seq]
  std::vector<owned_tensor> alone_ids, alone_targets;  // [1, length] per sequence
  std::vector<std::int64_t> counts;                    // targets not ignored per sequence
};

packed_batch make_batch(std::int64_t vocab) {
  testing::rng g(5);
  packed_batch p;
  p.ids = empty({1, seq}, dtype::i32);
  p.targets = empty({1, seq}, dtype::i32);
  p.segments = empty({1, seq}, dtype::i32);
  p.positions = empty({1, seq}, dtype::i32);
  auto* ids = p.ids.data_as<std::int32_t>();
  auto* tg = p.targets.data_as<std::int32_t>();
  auto* sg = p.segments.data_as<std::int32_t>();
  auto* ps = p.positions.data_as<std::int32_t>();
  std::int64_t at = 0;
  for (std::size_t s = 0; s <= lengths.size(); ++s) {
    const std::int64_t len = s < lengths.size() ? lengths[s] : seq - at;  // the last: padding
    const std::int64_t start = at;
    for (std::int64_t i = 0; i < len; ++i, ++at) {
      ids[at] = static_cast<std::int32_t>(g.integer(0, vocab - 1));
      sg[at] = static_cast<std::int32_t>(s);
      ps[at] = static_cast<std::int32_t>(i);
    }
    std::int64_t count = 0;
    for (std::int64_t i = start; i < at; ++i) {  // next token within the sequence, some ignored
      const bool keep = s < lengths.size() && i + 1 < at && g.integer(0, 3) != 0;
      tg[i] = keep ? ids[i + 1] : -100;
      count += keep ? 1 : 0;
    }
    if (s == lengths.size()) break;
    owned_tensor a = empty({1, len}, dtype::i32), t = empty({1, len}, dtype::i32);
    std::memcpy(a.data(), ids + start, static_cast<std::size_t>(len) * 4);
    std::memcpy(t.data(), tg + start, static_cast<std::size_t>(len) * 4);
    p.alone_ids.push_back(std::move(a));
    p.alone_targets.push_back(std::move(t));
    p.counts.push_back(count);
  }
  return p;
}

struct run_result {
  double loss = 0;
  std::vector<double> grads;
};

std::vector<double> grads_of(const layer_memory& m) {
  const tensor& g = m.grads();
  std::vector<double> out(static_cast<std::size_t>(g.numel()));
  for (std::int64_t i = 0; i < g.numel(); ++i)
    out[i] = g.type() == dtype::f32 ? g.data_as<float>()[i] : g.data_as<double>()[i];
  return out;
}

// The packed row in one forward and backward.
template <class M>
run_result packed(M& m, const packed_batch& p) {
  m.memory().zero_grads();
  m.set_packing(p.segments, p.positions);
  run_result r{m.forward(p.ids, p.targets), {}};
  m.backward(1.0);
  m.set_packing(tensor{}, tensor{});
  r.grads = grads_of(m.memory());
  return r;
}

// Each sequence alone; the mean over all targets is sum_i count_i loss_i / total, so each
// backward is scaled by count_i / total.
template <class M>
run_result separately(M& m, const packed_batch& p) {
  m.memory().zero_grads();
  std::int64_t total = 0;
  for (std::int64_t c : p.counts) total += c;
  run_result r;
  for (std::size_t s = 0; s < p.counts.size(); ++s) {
    const double w = static_cast<double>(p.counts[s]) / static_cast<double>(total);
    r.loss += w * m.forward(p.alone_ids[s], p.alone_targets[s]);
    m.backward(w);
  }
  r.grads = grads_of(m.memory());
  return r;
}

template <class M, class C>
void check_family(const C& cfg, const char* name) {
  INFO(name);
  const packed_batch p = make_batch(cfg.vocab);
  M f32(cfg, batch_dims{1, seq}, dtype::f32), f64(cfg, batch_dims{1, seq}, dtype::f64);
  f32.init_weights(3);
  f64.init_weights(3);  // the f32 weights exactly (init_values are f32-representable)
  const run_result got = packed(f32, p), ref = separately(f32, p), exact = separately(f64, p);
  // One scalar: a few roundings of a sum of ~15 terms, so the floor (a few ulps) decides.
  const auto lv =
      tests::as_accurate_as(std::vector<double>{got.loss}, std::vector<double>{ref.loss},
                            std::vector<double>{exact.loss});
  INFO("loss " << got.loss << " " << lv.str());
  CHECK(lv.ok());
  // Gradients: the packed row adds the same terms as the separate runs in another order (other
  // tiles, one backward instead of three accumulated): default_k of the f32 reference's error.
  // A token that sees another sequence, or a position not restarted, is off by O(|grad|).
  const auto gv = tests::as_accurate_as(got.grads, ref.grads, exact.grads);
  INFO("grads " << gv.str());
  CHECK(gv.ok());
  // And the packed f64 run against the separate one, to f64 rounding.
  const run_result got64 = packed(f64, p);
  CHECK(got64.loss == Approx(exact.loss).epsilon(1e-12));
}

}  // namespace

TEST_CASE("a packed row gives the loss and gradients of its sequences run alone", "[cpu]") {
  check_family<gpt>(gpt_config{.vocab = 29, .max_seq = seq, .dim = 16, .n_layer = 2, .n_head = 2},
                    "gpt");
  check_family<llama>(llama_config{.vocab = 29,
                                   .dim = 16,
                                   .n_layer = 2,
                                   .n_head = 4,
                                   .n_kv_head = 2,
                                   .hidden = 24,
                                   .max_seq = seq},
                      "llama");
}
