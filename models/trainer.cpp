#include "models/trainer.hpp"

#include <chrono>
#include <string>

#include "models/hf/checkpoint.hpp"
#include "models/hf/training_state.hpp"
#include "models/run_state.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

owned_tensor f32_copy(const tensor& x) {
  auto out = empty(x.sizes(), dtype::f32, x.dev());
  ops::copy(x, out);
  return out;
}

// Runs forward on the rows (and backward of loss_scale * loss when asked); returns the loss.
double run_rows(causal_lm& model, std::vector<std::int32_t>& rows,
                std::vector<std::int32_t>& targets, int batch, int seq, bool backward,
                double loss_scale = 1.0) {
  targets.resize(rows.size());
  tensor ids(rows.data(), rows.size() * 4, dtype::i32, {batch, seq});
  tensor tg(targets.data(), targets.size() * 4, dtype::i32, {batch, seq});
  next_token_targets(ids, tg);
  // On a GPU model the ids and targets are copied to its device (causal_lm_of::forward): the only
  // per-step upload.
  double loss = model.forward(ids, tg);
  if (backward) model.backward(loss_scale);
  return loss;
}

}  // namespace

namespace {
// 16-bit models train f32 master weights; f32 and f64 models are their own master weights.
owned_tensor master_of(causal_lm& model) {
  const tensor& p = model.memory().params();
  return p.type() == dtype::f32 || p.type() == dtype::f64 ? owned_tensor() : f32_copy(p);
}
}  // namespace

trainer::trainer(causal_lm& model, const train_config& cfg)
    : model_(model),
      cfg_(cfg),
      master_(master_of(model)),
      opt_(master_.defined() ? master_.view() : model.memory().params(),
           {.beta1 = cfg.beta1,
            .beta2 = cfg.beta2,
            .eps = cfg.eps,
            .weight_decay = cfg.weight_decay}),
      scaler_(cfg.precision == "f16" ? cfg.loss_scale : 1.0, cfg.loss_scale_growth) {
  cfg_.validate();
  const tensor& p = model.memory().params();
  TROUPE_CHECK(dtype_name(p.type()) == cfg.precision, "trainer: precision ", cfg.precision,
               " needs a model built in ", cfg.precision, ", got ", dtype_name(p.type()));
  if (mixed()) {
    grads32_ = empty(p.sizes(), dtype::f32, p.dev());
    // The parameters' names over the master weights, for checkpoints and the decay exemption.
    const auto& slots = model.slots().slots();
    master_views_.reserve(slots.size() * 2);
    for (const auto& s : slots) {
      if (s.kind != slot_kind::param) continue;
      auto off = (static_cast<const char*>(s.field->data()) - static_cast<const char*>(p.data())) /
                 static_cast<std::ptrdiff_t>(p.element_size());
      master_views_.push_back(master_.narrow(0, off, s.field->numel()).reshape(s.sizes));
      master_views_.push_back(grads32_.narrow(0, off, s.field->numel()).reshape(s.sizes));
      master_slots_.param(s.name, s.sizes, master_views_[master_views_.size() - 2],
                          master_views_.back(), s.spec);
    }
  }
  if (cfg.decay_exempt)
    opt_.exempt_from_decay(mixed() ? master_slots_ : model.slots(), weights(),
                           biases_norms_embeddings);
}

step_result trainer::step(const batch_source& data) {
  const int b = static_cast<int>(cfg_.batch), t = static_cast<int>(cfg_.seq);
  return step([&](causal_lm& m, std::uint64_t draw, double scale) {
    data(draw, b, t, rows_);
    return run_rows(m, rows_, targets_, b, t, true, scale);
  });
}

step_result trainer::step(const micro_batch& run) {
  auto t0 = std::chrono::steady_clock::now();
  auto& mem = model_.memory();
  mem.zero_grads();
  double loss = 0;
  step_result r;
  const double loss_scale = scaler_.scale();
  r.loss_scale = loss_scale;
  for (std::int64_t k = 0; k < cfg_.grad_accum; ++k) {
    std::uint64_t draw =
        cfg_.fixed_batch ? 0 : static_cast<std::uint64_t>(step_ * cfg_.grad_accum + k);
    loss += run(model_, draw, loss_scale);
  }
  loss /= static_cast<double>(cfg_.grad_accum);
  if (mixed()) ops::copy(mem.grads(), grads32_);
  const double unscale = 1.0 / (static_cast<double>(cfg_.grad_accum) * loss_scale);
  if (unscale != 1.0) ops::scale(grads(), unscale);
  r.lr = warmup_cosine_lr(step_, cfg_.warmup, cfg_.steps, cfg_.lr, cfg_.min_lr);
  // f16: an inf or NaN anywhere skips the update and halves the scale (loss_scaler.hpp).
  if (cfg_.precision == "f16") r.skipped = scaler_.update(!ops::all_finite(grads()));
  if (!r.skipped) {
    r.grad_norm = clip_grad_norm(grads(), cfg_.clip);
    opt_.step(weights(), grads(), r.lr);
    if (mixed()) ops::copy(master_, mem.params());  // round the master weights into the model
  }
  ++step_;
  r.step = step_;
  r.loss = loss;
  r.tokens = cfg_.batch * cfg_.seq * cfg_.grad_accum;
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

expected<std::filesystem::path> trainer::save(const std::filesystem::path& folder,
                                              const hf::model_config& cfg) const {
  using result = expected<std::filesystem::path>;
  return hf::save_folder_atomically(folder, [&](const std::filesystem::path& dir) -> result {
    // An f64 run saves its weights in f64: rounded to f32 they would no longer be the exact
    // reference of an f32 run (tests/rounding.hpp).
    const hf::save_options o{.weights = model_.memory().params().type() == dtype::f64 ? dtype::f64
                                                                                      : dtype::f32};
    auto files = hf::save_checkpoint(dir, cfg, mixed() ? master_slots_ : model_.slots(), o);
    if (!files) return result::failure(files.error_message());
    hf::training_state st{.step = step_,
                          .optimizer_steps = opt_.steps_taken(),
                          .extra_json = run_state_extra(cfg_, scaler_.json())};
    auto ts = hf::save_training_state(dir, st, opt_.m(), opt_.v());
    if (!ts) return result::failure(ts.error_message());
    return dir;
  });
}

expected<std::int64_t> trainer::resume(const std::filesystem::path& folder,
                                       const hf::model_config& cfg) {
  auto saved = resumable_state(folder, cfg_, opt_.m().sizes());  // before anything is loaded
  if (!saved) return expected<std::int64_t>::failure(saved.error_message());
  auto w = hf::load_weights(folder, cfg, mixed() ? master_slots_ : model_.slots());
  if (!w) return expected<std::int64_t>::failure(w.error_message());
  if (mixed()) ops::copy(master_, model_.memory().params());
  auto st = hf::load_training_state(folder, opt_.m(), opt_.v());
  if (!st) return expected<std::int64_t>::failure(st.error_message());
  step_ = st->step;
  opt_.set_steps_taken(st->optimizer_steps);
  // The loss scale goes on only from an f16 run, the single process's or a plan's.
  if (cfg_.precision == "f16") scaler_.resume_from(st->extra_json);
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
