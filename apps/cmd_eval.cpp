// troupe eval: the loss of a checkpoint on a token file or text; --json also gives the logits of
// the last position of the first sequence.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <memory>

#include "apps/commands.hpp"
#include "models/causal_lm.hpp"
#include "models/data_source.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/targets.hpp"
#include "models/trainer.hpp"

namespace troupe::apps {
namespace {

struct eval_args {
  std::string model, tokens, text = "/usr/share/games/fortunes";
  int batch = 8, seq = 128, batches = 4;
  std::uint64_t seed = 1337, first = 1000000;
  bool json = false;
};

int run_eval(const eval_args& a) {
  auto cfg = models::hf::read_config(a.model).value();
  auto model = models::make_causal_lm(cfg, {a.batch, a.seq});
  models::hf::load_weights(a.model, cfg, model->slots()).value();
  auto data = models::open_data_source(a.tokens, a.text, model->vocab(), a.seed).value();
  double loss = models::evaluate(*model, data.rows, a.batch, a.seq, a.first, a.batches);
  if (!a.json) {
    fmt::print("{}: loss {:.6f} over {} batches of {} x {} tokens from {}\n", a.model, loss,
               a.batches, a.batch, a.seq, data.description);
    return 0;
  }
  // The logits of the last position of the first sequence of the first batch.
  std::vector<std::int32_t> rows, targets(static_cast<std::size_t>(a.batch) * a.seq);
  data.rows(a.first, a.batch, a.seq, rows);
  tensor ids(rows.data(), rows.size() * 4, dtype::i32, {a.batch, a.seq});
  tensor tg(targets.data(), targets.size() * 4, dtype::i32, {a.batch, a.seq});
  models::next_token_targets(ids, tg);
  model->forward(ids, tg);
  auto logits = to_device(model->logits(), device::cpu());
  const float* last = logits.data_as<float>() + (a.seq - 1) * model->vocab();
  fmt::print("{{\"loss\": {:.8g}, \"batches\": {}, \"last_logits\": [", loss, a.batches);
  for (std::int64_t i = 0; i < model->vocab(); ++i) fmt::print("{}{:.8g}", i ? ", " : "", last[i]);
  fmt::print("]}}\n");
  return 0;
}

}  // namespace

command_fn add_eval_command(CLI::App& app) {
  auto a = std::make_shared<eval_args>();
  auto* sub = app.add_subcommand("eval", "Loss of a checkpoint on a token file or text");
  sub->add_option("--model", a->model, "HF model folder (config.json + safetensors)")->required();
  sub->add_option("--tokens", a->tokens, "Token file (troupe tokenize)");
  sub->add_option("--text", a->text, "Text file or folder, bytes as tokens")->capture_default_str();
  sub->add_option("--batch,-B", a->batch, "Sequences per batch")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--seq,-T", a->seq, "Sequence length")
      ->capture_default_str()
      ->check(CLI::Range(2, 1 << 20));
  sub->add_option("--batches", a->batches, "Batches to average")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  sub->add_option("--seed", a->seed, "Seed of the batch order")->capture_default_str();
  sub->add_option("--first", a->first, "First draw of the batch order (training draws from 0)")
      ->capture_default_str();
  sub->add_flag("--json", a->json, "Print JSON with the logits of the last position");
  return [sub, a]() -> int {
    if (!sub->parsed()) return -1;
    return run_eval(*a);
  };
}

}  // namespace troupe::apps
