// rl_model: models, trainers and weight pushes of the RL role actors (rl_model.hpp).
#include "actors/rl_model.hpp"

#include <chrono>

#include "memory/error.hpp"
#include "models/hf/checkpoint.hpp"

namespace troupe::actors {

rl_built_model build_rl_model(const grpo_model_setup& s, bool load, const std::string& who) {
  TROUPE_CHECK(s.rows > 0 && s.seq > 0, who, ": rows ", s.rows, " and seq ", s.seq, " must be > 0");
  auto cfg = models::hf::read_config(s.checkpoint);
  TROUPE_CHECK(cfg.has_value(), who, ": ", cfg.error_message());
  rl_built_model b{*cfg, models::make_causal_lm(*cfg, {s.rows, s.seq})};
  if (load) {
    auto files = models::hf::load_weights(s.checkpoint, b.cfg, b.model->slots());
    TROUPE_CHECK(files.has_value(), who, ": ", files.error_message());
  }
  return b;
}

models::train_config rl_train_config(const grpo_model_setup& m, double lr, double weight_decay,
                                     double clip, double beta1, double beta2, std::int64_t warmup) {
  models::train_config tc;
  tc.lr = tc.min_lr = lr;  // a constant rate after the warmup
  tc.warmup = warmup;
  tc.steps = 1 << 30;
  tc.weight_decay = weight_decay;
  tc.clip = clip;
  tc.beta1 = beta1;
  tc.beta2 = beta2;
  tc.batch = m.rows;
  tc.seq = m.seq;
  return tc;
}

grpo_push_reply push_rl_weights(role_context& c, const tensor& params, std::int64_t version,
                                const std::vector<role_handle>& to) {
  c.set_activity("pushing weights");
  const auto t0 = std::chrono::steady_clock::now();
  const std::string name = std::string(rl_weights_prefix) + std::to_string(version);
  const std::vector<std::int64_t> dims(params.sizes().begin(), params.sizes().end());
  std::vector<tensor_send> sends;
  for (const auto& h : to)
    sends.push_back(c.send_tensor(h, params.data(), params.type(), dims, name));
  for (auto& s : sends) s.wait(std::chrono::milliseconds(60000));
  c.set_activity("idle");
  return grpo_push_reply{
      .version = version,
      .bytes = static_cast<std::int64_t>(params.nbytes() * to.size()),
      .seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()};
}

}  // namespace troupe::actors
