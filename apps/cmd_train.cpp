// troupe train: single-process training of a small GPT on byte-level text (for now the demo; the
// full trainer with HF checkpoints and job files comes with the models issue).
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cmath>
#include <memory>
#include <random>

#include "apps/commands.hpp"
#include "memory/tier.hpp"
#include "models/byte_data.hpp"
#include "models/gpt.hpp"
#include "models/optim.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"

namespace troupe::apps {
namespace {

struct train_args {
  bool demo = false;
  std::string corpus = "/usr/share/games/fortunes";
  int steps = 300, batch = 8, seq = 128, layers = 4, dim = 128, heads = 4;
  double lr = 3e-3, min_lr = 3e-4, weight_decay = 0.1, clip = 1.0;
  int warmup = 30, log_every = 25, sample_chars = 240, threads = 0;
  std::uint64_t seed = 1337;
  bool fixed_batch = false;
  std::string prompt = "The ";
};

std::string sample_text(models::gpt& model, const std::string& prompt, int chars, int max_t,
                        std::uint64_t seed) {
  std::mt19937_64 gen(seed);
  std::vector<std::int32_t> ctx(prompt.begin(), prompt.end());
  std::string out = prompt;
  for (int n = 0; n < chars; ++n) {
    std::int64_t start = std::max<std::int64_t>(0, static_cast<std::int64_t>(ctx.size()) - max_t);
    std::int64_t t = static_cast<std::int64_t>(ctx.size()) - start;
    tensor ids(ctx.data() + start, t * 4, dtype::i32, {1, t});
    model.forward(ids, ids);
    const float* row = model.logits().data_as<float>() + (t - 1) * model.config().vocab;
    // Temperature 0.8 sampling.
    std::vector<double> p(model.config().vocab);
    double mx = -1e30, z = 0;
    for (std::size_t i = 0; i < p.size(); ++i) mx = std::max(mx, double(row[i]) / 0.8);
    for (std::size_t i = 0; i < p.size(); ++i) z += p[i] = std::exp(double(row[i]) / 0.8 - mx);
    double u = std::uniform_real_distribution<double>(0, z)(gen);
    std::size_t pick = 0;
    for (; pick + 1 < p.size() && (u -= p[pick]) > 0; ++pick) {
    }
    ctx.push_back(static_cast<std::int32_t>(pick));
    out.push_back(static_cast<char>(pick));
  }
  return out;
}

int run_train(const train_args& a) {
  if (a.threads > 0) parallel::set_num_threads(a.threads);
  auto corpus = models::read_text_corpus(a.corpus);
  models::gpt_config cfg{
      .vocab = 256, .max_seq = a.seq, .dim = a.dim, .n_layer = a.layers, .n_head = a.heads};
  models::gpt model(cfg, {a.batch, a.seq});
  model.init_weights(a.seed);
  auto& mem = model.memory();
  models::adamw_optimizer opt(mem.params(), {.weight_decay = a.weight_decay});
  fmt::print("troupe train: GPT {} layers x {} wide, {} heads, T={}, B={}, {:.2f} M parameters\n",
             a.layers, a.dim, a.heads, a.seq, a.batch,
             static_cast<double>(model.slots().param_count()) / 1e6);
  fmt::print("corpus: {} ({:.1f} MB of text, byte-level tokens); {} threads\n", a.corpus,
             static_cast<double>(corpus.size()) / 1e6, parallel::num_threads());
  fmt::print(
      "memory planned before step 1: params {:.1f} MB, grads {:.1f} MB, activations {:.1f} "
      "MB, scratch {:.1f} MB\n",
      mem.param_bytes() / 1e6, mem.param_bytes() / 1e6, mem.activation_bytes() / 1e6,
      mem.scratch_bytes() / 1e6);
  std::vector<std::int32_t> rows;
  std::vector<std::int32_t> in(static_cast<std::size_t>(a.batch) * a.seq),
      tg(static_cast<std::size_t>(a.batch) * a.seq);
  tensor ids(in.data(), in.size() * 4, dtype::i32, {a.batch, a.seq});
  tensor targets(tg.data(), tg.size() * 4, dtype::i32, {a.batch, a.seq});
  auto t0 = std::chrono::steady_clock::now();
  auto last = t0;
  double first_loss = 0, loss = 0;
  for (int step = 0; step < a.steps; ++step) {
    models::sample_batch(corpus, a.seed, a.fixed_batch ? 0 : step, a.batch, a.seq, rows);
    for (int b = 0; b < a.batch; ++b)
      for (int t = 0; t < a.seq; ++t) {
        in[b * a.seq + t] = rows[b * (a.seq + 1) + t];
        tg[b * a.seq + t] = rows[b * (a.seq + 1) + t + 1];
      }
    mem.zero_grads();
    loss = model.forward(ids, targets);
    if (step == 0) first_loss = loss;
    model.backward();
    double norm = models::clip_grad_norm(mem.grads(), a.clip);
    double lr = models::warmup_cosine_lr(step, a.warmup, a.steps, a.lr, a.min_lr);
    opt.step(mem.params(), mem.grads(), lr);
    if ((step + 1) % a.log_every == 0 || step == 0 || step + 1 == a.steps) {
      auto now = std::chrono::steady_clock::now();
      int n =
          step == 0 ? 1 : ((step + 1) % a.log_every == 0 ? a.log_every : (step + 1) % a.log_every);
      double secs = std::chrono::duration<double>(now - last).count();
      last = now;
      fmt::print("step {:4d}/{}  loss {:.4f}  grad norm {:.3f}  lr {:.2e}  {:.0f} tokens/s\n",
                 step + 1, a.steps, loss, norm, lr, n * a.batch * a.seq / secs);
      std::fflush(stdout);
    }
  }
  double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print(
      "trained {} steps in {:.1f} s ({:.0f} tokens/s); loss {:.3f} -> {:.3f}; host memory "
      "peak {:.1f} MB\n",
      a.steps, total, a.steps * double(a.batch) * a.seq / total, first_loss, loss,
      memory::stats(memory::tier::host).peak / 1e6);
  if (a.sample_chars > 0) {
    models::gpt sampler(cfg, {1, a.seq});
    ops::copy(mem.params(), sampler.memory().params());
    fmt::print("sample (temperature 0.8):\n{}\n",
               sample_text(sampler, a.prompt, a.sample_chars, a.seq, a.seed));
  }
  return 0;
}

}  // namespace

command_fn add_train_command(CLI::App& app) {
  auto a = std::make_shared<train_args>();
  auto* sub = app.add_subcommand("train", "Train a small GPT on byte-level text (single process)");
  sub->add_flag("--demo", a->demo, "Run the demo: a small GPT on the fortunes corpus");
  sub->add_option("--corpus", a->corpus, "Text file or folder of text files")
      ->capture_default_str();
  sub->add_option("--steps", a->steps, "Optimizer steps")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--batch,-B", a->batch, "Sequences per step")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--seq,-T", a->seq, "Sequence length")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--layers", a->layers, "Transformer blocks")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--dim", a->dim, "Model width")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--heads", a->heads, "Attention heads")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--lr", a->lr, "Peak learning rate")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--min-lr", a->min_lr, "Final learning rate of the cosine decay")
      ->capture_default_str();
  sub->add_option("--warmup", a->warmup, "Warmup steps")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  sub->add_option("--weight-decay", a->weight_decay, "AdamW weight decay")->capture_default_str();
  sub->add_option("--clip", a->clip, "Gradient-norm clip (0: off)")->capture_default_str();
  sub->add_option("--seed", a->seed, "Seed of weights and batch order")->capture_default_str();
  sub->add_option("--threads", a->threads, "CPU threads (0: all)")->capture_default_str();
  sub->add_option("--log-every", a->log_every, "Steps between log lines")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--sample", a->sample_chars, "Characters to generate at the end")
      ->capture_default_str();
  sub->add_option("--prompt", a->prompt, "Prompt of the generated text")->capture_default_str();
  sub->add_flag("--fixed-batch", a->fixed_batch,
                "Train repeatedly on one batch (overfitting check)");
  return [sub, a]() -> int {
    if (!sub->parsed()) return -1;
    return run_train(*a);
  };
}

}  // namespace troupe::apps
