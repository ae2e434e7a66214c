// ppo_roles: the PPO policy and critic role actors (ppo_roles.hpp).
#include "actors/ppo_roles.hpp"

#include <array>
#include <memory>
#include <string>

#include "actors/rl_model.hpp"
#include "memory/error.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/post/ppo_step.hpp"

namespace troupe::actors {
namespace {

void check_rows(const grpo_samples& s, std::size_t per_token, const std::string& who) {
  const auto n = static_cast<std::size_t>(s.rows * s.seq);
  TROUPE_CHECK(s.rows > 0 && s.ids.size() == n && s.targets.size() == n, who, ": samples of ",
               s.rows, " x ", s.seq, " rows carry ", s.ids.size(), " ids and ", s.targets.size(),
               " targets");
  TROUPE_CHECK(per_token == n, who, ": ", n, " per-token values needed, got ", per_token);
}

models::ppo_options options_of(const ppo_trainer_setup& s) {
  return {.cliprange = s.cliprange, .cliprange_value = s.cliprange_value, .vf_coef = s.vf_coef};
}

void fill_rows(models::ppo_batch& b, const grpo_samples& s) {
  b.rows = s.rows;
  b.seq = s.seq;
  b.ids = s.ids;
  b.targets = s.targets;
}

// `epochs` trainer steps of `micro`, their means.
template <class Micro, class Seen>
ppo_train_reply run_epochs(models::trainer& t, std::int64_t epochs, const Micro& micro,
                           const Seen& seen) {
  ppo_train_reply out;
  for (std::int64_t e = 0; e < epochs; ++e) {
    const auto step = t.step(micro);
    const auto s = seen();
    out.loss += step.loss / static_cast<double>(epochs);
    out.clipfrac += s[0] / static_cast<double>(epochs);
    out.approx_kl += s[1] / static_cast<double>(epochs);
    out.entropy += s[2] / static_cast<double>(epochs);
    out.grad_norm = step.grad_norm;
    out.lr = step.lr;
    out.seconds += step.seconds;
  }
  out.version = t.steps_done();
  return out;
}

void make_policy(role_builder& b, role_context&) {
  struct state {
    rl_built_model m;
    std::unique_ptr<models::trainer> t;
    ppo_trainer_setup setup;
    std::shared_ptr<models::ppo_batch> batch = std::make_shared<models::ppo_batch>();
  };
  auto st = std::make_shared<state>();
  b.on<ppo_trainer_setup>([st](role_context& c, const ppo_trainer_setup& s) {
    TROUPE_CHECK(s.epochs > 0, c.name(), ": epochs ", s.epochs, " must be > 0");
    st->m = build_rl_model(s.model, true, c.name());
    st->t = std::make_unique<models::trainer>(
        *st->m.model,
        rl_train_config(s.model, s.lr, s.weight_decay, s.clip, s.beta1, s.beta2, s.warmup));
    st->setup = s;
    return std::int64_t{0};
  });
  b.on<ppo_policy_train_request>([st](role_context& c, const ppo_policy_train_request& r) {
    TROUPE_CHECK(st->t, c.name(), ": a step before the setup");
    check_rows(r.samples, r.advantages.size(), c.name());
    check_rows(r.samples, r.samples.old_logp.size(), c.name());
    c.set_activity("training");
    fill_rows(*st->batch, r.samples);
    st->batch->old_logp = r.samples.old_logp;
    st->batch->advantages = r.advantages;
    models::ppo_policy_report last;
    const auto micro = models::ppo_policy_micro_batch(
        st->batch, options_of(st->setup), [&](const models::ppo_policy_report& p) { last = p; });
    const ppo_train_reply out = run_epochs(*st->t, st->setup.epochs, micro, [&] {
      return std::array<double, 3>{last.loss.clipfrac, last.loss.approx_kl, last.entropy};
    });
    c.record_step(out.version, {{"loss", out.loss}, {"clipfrac", out.clipfrac}});
    c.set_activity("idle");
    return out;
  });
  add_policy_save_push(b, st);
}

void make_critic(role_builder& b, role_context&) {
  struct state {
    std::unique_ptr<models::value_model> v;
    std::unique_ptr<models::trainer> t;
    ppo_trainer_setup setup;
    std::shared_ptr<models::ppo_batch> batch = std::make_shared<models::ppo_batch>();
  };
  auto st = std::make_shared<state>();
  b.on<ppo_trainer_setup>([st](role_context& c, const ppo_trainer_setup& s) {
    TROUPE_CHECK(s.epochs > 0, c.name(), ": epochs ", s.epochs, " must be > 0");
    TROUPE_CHECK(s.model.rows > 0 && s.model.seq > 0, c.name(), ": rows ", s.model.rows,
                 " and seq ", s.model.seq, " must be > 0");
    auto cfg = models::hf::read_config(s.model.checkpoint);
    TROUPE_CHECK(cfg.has_value(), c.name(), ": ", cfg.error_message());
    st->v = std::make_unique<models::value_model>(
        *cfg, models::batch_dims{s.model.rows, s.model.seq}, /*pad_id=*/0);
    st->v->lm().init_weights(s.seed);  // the score head's start; the trunk is the checkpoint's
    auto loaded = st->v->scored().load(s.model.checkpoint, s.need_score);
    TROUPE_CHECK(loaded.has_value(), c.name(), ": ", loaded.error_message());
    st->t = std::make_unique<models::trainer>(
        st->v->lm(),
        rl_train_config(s.model, s.lr, s.weight_decay, s.clip, s.beta1, s.beta2, s.warmup));
    st->setup = s;
    return std::int64_t{0};
  });
  b.on<ppo_value_request>([st](role_context& c, const ppo_value_request& r) {
    TROUPE_CHECK(st->v, c.name(), ": a request before the setup");
    check_rows(r.samples, r.samples.ids.size(), c.name());
    c.set_activity("values");
    auto v = st->v->forward(models::i32_rows(r.samples.ids, r.samples.rows, r.samples.seq));
    for (std::size_t i = 0; i < v.size(); ++i)
      if (r.samples.targets[i] == -100) v[i] = 0.0;
    c.set_activity("idle");
    return v;
  });
  b.on<ppo_critic_train_request>([st](role_context& c, const ppo_critic_train_request& r) {
    TROUPE_CHECK(st->t, c.name(), ": a step before the setup");
    check_rows(r.samples, r.old_values.size(), c.name());
    check_rows(r.samples, r.returns.size(), c.name());
    c.set_activity("training");
    fill_rows(*st->batch, r.samples);
    st->batch->old_values = r.old_values;
    st->batch->returns = r.returns;
    models::ppo_value_result last;
    const auto micro =
        models::ppo_value_micro_batch(st->batch, *st->v, options_of(st->setup),
                                      [&](const models::ppo_value_result& v) { last = v; });
    const ppo_train_reply out = run_epochs(*st->t, st->setup.epochs, micro, [&] {
      return std::array<double, 3>{last.clipfrac, 0.0, 0.0};
    });
    c.record_step(out.version, {{"value loss", out.loss}});
    c.set_activity("idle");
    return out;
  });
  b.on<grpo_save_request>([st](role_context& c, const grpo_save_request& r) {
    TROUPE_CHECK(st->t, c.name(), ": a save before the setup");
    c.set_activity("saving");
    auto saved = models::hf::save_folder_atomically(
        r.dir, [&](const std::filesystem::path& dir) { return st->v->scored().save(dir); });
    TROUPE_CHECK(saved.has_value(), c.name(), ": ", saved.error_message());
    c.set_activity("idle");
    return grpo_save_reply{.version = st->t->steps_done(), .held = -1};
  });
}

}  // namespace

void add_ppo_roles(role_registry& roles, grpo_reward_fn reward) {
  add_grpo_roles(roles, std::move(reward));
  roles.add("ppo_policy", make_policy);
  roles.add("ppo_critic", make_critic);
}

}  // namespace troupe::actors
