#include "models/trainer.hpp"

#include <chrono>
#include <string>

#include "models/hf/checkpoint.hpp"
#include "models/hf/training_state.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

// Runs forward on the rows (and backward when asked); returns the loss.
double run_rows(causal_lm& model, std::vector<std::int32_t>& rows,
                std::vector<std::int32_t>& targets, int batch, int seq, bool backward) {
  targets.resize(rows.size());
  tensor ids(rows.data(), rows.size() * 4, dtype::i32, {batch, seq});
  tensor tg(targets.data(), targets.size() * 4, dtype::i32, {batch, seq});
  next_token_targets(ids, tg);
  double loss = model.forward(ids, tg);
  if (backward) model.backward();
  return loss;
}

}  // namespace

trainer::trainer(causal_lm& model, const train_config& cfg)
    : model_(model),
      cfg_(cfg),
      opt_(model.memory().params(), {.beta1 = cfg.beta1,
                                     .beta2 = cfg.beta2,
                                     .eps = cfg.eps,
                                     .weight_decay = cfg.weight_decay}) {
  cfg_.validate();
  if (cfg.decay_exempt)
    opt_.exempt_from_decay(model.slots(), model.memory().params(), biases_norms_embeddings);
}

step_result trainer::step(const batch_source& data) {
  auto t0 = std::chrono::steady_clock::now();
  auto& mem = model_.memory();
  const int b = static_cast<int>(cfg_.batch), t = static_cast<int>(cfg_.seq);
  mem.zero_grads();
  double loss = 0;
  for (std::int64_t k = 0; k < cfg_.grad_accum; ++k) {
    std::uint64_t draw =
        cfg_.fixed_batch ? 0 : static_cast<std::uint64_t>(step_ * cfg_.grad_accum + k);
    data(draw, b, t, rows_);
    loss += run_rows(model_, rows_, targets_, b, t, true);
  }
  loss /= static_cast<double>(cfg_.grad_accum);
  if (cfg_.grad_accum > 1) ops::scale(mem.grads(), 1.0 / static_cast<double>(cfg_.grad_accum));
  step_result r;
  r.grad_norm = clip_grad_norm(mem.grads(), cfg_.clip);
  r.lr = warmup_cosine_lr(step_, cfg_.warmup, cfg_.steps, cfg_.lr, cfg_.min_lr);
  opt_.step(mem.params(), mem.grads(), r.lr);
  ++step_;
  r.step = step_;
  r.loss = loss;
  r.tokens = cfg_.batch * cfg_.seq * cfg_.grad_accum;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

expected<std::filesystem::path> trainer::save(const std::filesystem::path& folder,
                                              const hf::model_config& cfg) const {
  auto files = hf::save_checkpoint(folder, cfg, model_.slots());
  if (!files) return expected<std::filesystem::path>::failure(files.error_message());
  hf::training_state st{.step = step_,
                        .optimizer_steps = opt_.steps_taken(),
                        .extra_json = "{\"seed\": " + std::to_string(cfg_.seed) + "}"};
  auto ts = hf::save_training_state(folder, st, opt_.m(), opt_.v());
  if (!ts) return expected<std::filesystem::path>::failure(ts.error_message());
  return folder;
}

expected<std::int64_t> trainer::resume(const std::filesystem::path& folder,
                                       const hf::model_config& cfg) {
  auto w = hf::load_weights(folder, cfg, model_.slots());
  if (!w) return expected<std::int64_t>::failure(w.error_message());
  auto st = hf::load_training_state(folder, opt_.m(), opt_.v());
  if (!st) return expected<std::int64_t>::failure(st.error_message());
  step_ = st->step;
  opt_.set_steps_taken(st->optimizer_steps);
  return step_;
}

double evaluate(causal_lm& model, const trainer::batch_source& data, int batch, int seq,
                std::uint64_t first, int batches) {
  std::vector<std::int32_t> rows, targets;
  double total = 0;
  for (int i = 0; i < batches; ++i) {
    data(first + static_cast<std::uint64_t>(i), batch, seq, rows);
    total += run_rows(model, rows, targets, batch, seq, false);
  }
  return total / batches;
}

}  // namespace troupe::models
