// addition_task: the RL examples' verifiable task (addition_task.hpp).
#include "apps/examples/addition_task.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <cstdio>

#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/trainer.hpp"

namespace troupe::examples {
namespace {

struct problem {
  int a = 0, b = 0;
  std::string prompt() const { return fmt::format("{}+{}=", a, b); }
  std::string answer() const { return fmt::format("{}\n", a + b); }
};

problem draw(std::mt19937_64& g, int digits) {
  std::uniform_int_distribution<int> d(digits == 1 ? 0 : 10, digits == 1 ? 9 : 99);
  const int a = d(g);
  return {a, d(g)};
}

}  // namespace

std::vector<std::int32_t> addition_task::prompts(std::mt19937_64& g, std::int64_t n) const {
  std::vector<std::int32_t> out;
  for (std::int64_t i = 0; i < n; ++i)
    for (char ch : draw(g, digits).prompt()) out.push_back(static_cast<unsigned char>(ch));
  return out;
}

double addition_task::verify(std::span<const std::int32_t> prompt,
                             std::span<const std::int32_t> completion) const {
  std::string p(prompt.begin(), prompt.end()), c(completion.begin(), completion.end());
  int a = 0, b = 0;
  if (std::sscanf(p.c_str(), "%d+%d=", &a, &b) != 2) return 0.0;
  const std::string want = fmt::format("{}\n", a + b);
  if (c == want) return 1.0;
  if (!partial_credit) return 0.0;
  std::size_t right = 0;
  for (std::size_t i = 0; i < want.size() && i < c.size(); ++i) right += c[i] == want[i];
  return static_cast<double>(right) / static_cast<double>(std::max(want.size(), c.size()));
}

models::hf::model_config tiny_llama() {
  models::hf::llama_config c;
  c.vocab_size = 256;
  c.hidden_size = 64;
  c.intermediate_size = 176;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.max_position_embeddings = 16;
  c.rms_norm_eps = 1e-5;
  return models::hf::model_config(c);
}

std::filesystem::path addition_task::sft(const std::filesystem::path& folder, std::int64_t steps,
                                         std::uint64_t seed, double lr, double noise) const {
  const auto cfg = tiny_llama();
  const std::int64_t batch = 64, seq = prompt_len() + max_new(), plen = prompt_len();
  auto m = models::make_causal_lm(cfg, {batch, seq});
  m->init_weights(seed);
  models::train_config tc;
  tc.lr = lr;
  tc.min_lr = lr / 10;
  tc.warmup = 20;
  tc.steps = steps;
  tc.weight_decay = 0.0;
  tc.batch = batch;
  tc.seq = seq;
  tc.seed = seed;
  models::trainer t(*m, tc);
  std::vector<std::int32_t> ids, targets;
  std::mt19937_64 g(seed);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::uniform_int_distribution<int> wrong(0, digits == 1 ? 18 : 198);
  const auto step = [&](models::causal_lm& model, std::uint64_t, double loss_scale) {
    ids.assign(static_cast<std::size_t>(batch * seq), eos);
    targets.assign(ids.size(), -100);
    for (std::int64_t r = 0; r < batch; ++r) {
      const problem p = draw(g, digits);
      const bool noisy = coin(g) < noise;
      const std::string text = p.prompt() + (noisy ? fmt::format("{}\n", wrong(g)) : p.answer());
      for (std::size_t i = 0; i < text.size(); ++i) {
        ids[static_cast<std::size_t>(r * seq) + i] = static_cast<unsigned char>(text[i]);
        if (i >= static_cast<std::size_t>(plen))
          targets[static_cast<std::size_t>(r * seq) + i - 1] = static_cast<unsigned char>(text[i]);
      }
    }
    const double loss =
        model.forward(tensor(ids.data(), ids.size() * 4, dtype::i32, {batch, seq}),
                      tensor(targets.data(), targets.size() * 4, dtype::i32, {batch, seq}));
    model.backward(loss_scale);
    return loss;
  };
  double first = 0, last = 0;
  for (std::int64_t s = 0; s < steps; ++s) {
    last = t.step(step).loss;
    if (s == 0) first = last;
  }
  fmt::print("sft: {} steps, answer loss {:.3f} -> {:.3f}\n", steps, first, last);
  auto saved = t.save(folder, cfg);
  TROUPE_CHECK(saved.has_value(), "sft: ", saved.error_message());
  return *saved;
}

}  // namespace troupe::examples
