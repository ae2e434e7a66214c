// grpo_roles: the rollout, reward, reference and trainer role actors of GRPO (grpo_roles.hpp).
#include "actors/grpo_roles.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "actors/rl_model.hpp"
#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/hf/config.hpp"
#include "models/post/grpo_step.hpp"
#include "models/post/rollout.hpp"
#include "models/trainer.hpp"

namespace troupe::actors {
namespace {

using clock_type = std::chrono::steady_clock;
constexpr std::string_view weights_prefix = rl_weights_prefix;

double since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

using built_model = rl_built_model;

tensor i32_rows(const std::vector<std::int32_t>& v, std::int64_t rows, std::int64_t seq) {
  return tensor(const_cast<std::int32_t*>(v.data()), v.size() * 4, dtype::i32, {rows, seq});
}

void check_samples(const grpo_samples& s, const std::string& who) {
  const auto n = static_cast<std::size_t>(s.rows * s.seq);
  TROUPE_CHECK(s.rows > 0 && s.ids.size() == n && s.targets.size() == n &&
                   s.lengths.size() == static_cast<std::size_t>(s.rows),
               who, ": samples of ", s.rows, " x ", s.seq, " rows carry ", s.ids.size(), " ids, ",
               s.targets.size(), " targets and ", s.lengths.size(), " lengths");
}

void make_rollout(role_builder& b, role_context&) {
  struct state {
    built_model m;
    std::int64_t version = -1;
  };
  auto st = std::make_shared<state>();
  b.on<grpo_model_setup>([st](role_context& c, const grpo_model_setup& s) {
    st->m = build_rl_model(s, false, c.name());
    st->version = -1;
    return st->version;
  });
  b.on<grpo_version_request>(
      [st](role_context&, const grpo_version_request&) { return st->version; });
  // Weights from the trainer: "grpo-weights v<N>", the flat parameter buffer.
  b.on_tensor([st](role_context& c, const tensor_info& t) {
    TROUPE_CHECK(st->m.model, c.name(), ": weights arrived before the setup");
    TROUPE_CHECK(t.name.starts_with(weights_prefix), c.name(), ": unexpected tensor '", t.name,
                 "' from rank ", t.source);
    const tensor& p = st->m.model->memory().params();
    TROUPE_CHECK(t.type == p.type() && t.bytes == p.nbytes(), c.name(), ": weights '", t.name,
                 "' of ", t.bytes, " bytes do not fit this model's ", p.nbytes());
    c.set_activity("receiving " + t.name);
    c.receive(t, p.data(), p.nbytes(), std::chrono::milliseconds(60000));
    st->version = std::stoll(t.name.substr(weights_prefix.size()));
    c.set_metric("version", static_cast<double>(st->version));
    c.set_activity("idle");
  });
  b.on<grpo_rollout_request>([st](role_context& c, const grpo_rollout_request& r) {
    TROUPE_CHECK(st->m.model, c.name(), ": a rollout before the setup");
    TROUPE_CHECK(st->version >= r.min_version, c.name(), ": holds weights v", st->version,
                 " but the request needs v", r.min_version, " or newer");
    std::span<const std::int32_t> prompts(r.prompts);
    std::uint64_t seed = r.seed;
    if (!r.split.empty()) {
      const auto at = std::find(r.split.begin(), r.split.end(), c.name());
      TROUPE_CHECK(at != r.split.end(), c.name(),
                   ": not among the actors the prompts are split over");
      const auto i = static_cast<std::size_t>(at - r.split.begin());
      const std::size_t n =
          r.prompts.size() / static_cast<std::size_t>(std::max<std::int64_t>(1, r.prompt_len));
      TROUPE_CHECK(n % r.split.size() == 0, c.name(), ": ", n, " prompts do not split over ",
                   r.split.size(), " rollout actors");
      const std::size_t part = n / r.split.size() * static_cast<std::size_t>(r.prompt_len);
      prompts = prompts.subspan(i * part, part);
      seed += i;
    }
    c.set_activity("sampling");
    auto t0 = clock_type::now();
    models::rollout_options o;
    o.group = r.group;
    o.max_new = r.max_new;
    o.sampling.temperature = r.temperature;
    o.sampling.top_p = r.top_p;
    o.eos = r.eos;
    o.seed = seed;
    models::rollout_rows rows = models::sample_completions(*st->m.model, prompts, r.prompt_len, o);
    grpo_samples s;
    s.generate_seconds = since(t0);
    t0 = clock_type::now();
    s.old_logp = models::token_logprobs_of(*st->m.model, i32_rows(rows.ids, rows.rows, rows.seq),
                                           i32_rows(rows.targets, rows.rows, rows.seq));
    s.logprob_seconds = since(t0);
    s.rows = rows.rows;
    s.seq = rows.seq;
    s.prompt_len = rows.prompt_len;
    s.ids = std::move(rows.ids);
    s.targets = std::move(rows.targets);
    s.lengths = std::move(rows.lengths);
    s.version = st->version;
    c.set_activity("idle");
    return s;
  });
}

void make_reward(role_builder& b, role_context&, const grpo_reward_fn& reward) {
  b.on<grpo_reward_request>([reward](role_context& c, const grpo_reward_request& r) {
    const grpo_samples& s = r.samples;
    check_samples(s, c.name());
    std::vector<double> out(static_cast<std::size_t>(s.rows));
    for (std::int64_t i = 0; i < s.rows; ++i) {
      const std::int32_t* row = s.ids.data() + i * s.seq;
      out[static_cast<std::size_t>(i)] = reward(
          {row, static_cast<std::size_t>(s.prompt_len)},
          {row + s.prompt_len, static_cast<std::size_t>(s.lengths[static_cast<std::size_t>(i)])});
    }
    return out;
  });
}

void make_reference(role_builder& b, role_context&) {
  auto st = std::make_shared<built_model>();
  b.on<grpo_model_setup>([st](role_context& c, const grpo_model_setup& s) {
    *st = build_rl_model(s, true, c.name());
    return std::int64_t{0};
  });
  b.on<grpo_reference_request>([st](role_context& c, const grpo_reference_request& r) {
    TROUPE_CHECK(st->model, c.name(), ": a request before the setup");
    check_samples(r.samples, c.name());
    c.set_activity("log-probabilities");
    auto out = models::token_logprobs_of(
        *st->model, i32_rows(r.samples.ids, r.samples.rows, r.samples.seq),
        i32_rows(r.samples.targets, r.samples.rows, r.samples.seq));
    c.set_activity("idle");
    return out;
  });
}

void make_trainer(role_builder& b, role_context&) {
  struct state {
    built_model m;
    std::unique_ptr<models::trainer> t;
    models::grpo_options opt;
    std::shared_ptr<models::grpo_batch> batch = std::make_shared<models::grpo_batch>();
  };
  auto st = std::make_shared<state>();
  b.on<grpo_trainer_setup>([st](role_context& c, const grpo_trainer_setup& s) {
    st->m = build_rl_model(s.model, true, c.name());
    const models::train_config tc =
        rl_train_config(s.model, s.lr, s.weight_decay, s.clip, s.beta1, s.beta2, s.warmup);
    st->t = std::make_unique<models::trainer>(*st->m.model, tc);
    st->opt = {.epsilon = s.epsilon, .beta = s.beta};
    return std::int64_t{0};
  });
  b.on<grpo_train_request>([st](role_context& c, const grpo_train_request& r) {
    TROUPE_CHECK(st->t, c.name(), ": a step before the setup");
    check_samples(r.samples, c.name());
    c.set_activity("training");
    models::grpo_batch& gb = *st->batch;
    gb.rows = r.samples.rows;
    gb.seq = r.samples.seq;
    gb.ids = r.samples.ids;
    gb.targets = r.samples.targets;
    gb.old_logp = r.samples.old_logp;
    gb.ref_logp = r.ref_logp;
    gb.advantages = r.advantages;
    models::grpo_result seen;
    const auto step = st->t->step(models::grpo_micro_batch(
        st->batch, st->opt, [&](const models::grpo_result& g) { seen = g; }));
    grpo_train_reply out{.loss = step.loss,
                         .kl = seen.kl,
                         .clip_ratio = seen.clip_ratio,
                         .grad_norm = step.grad_norm,
                         .lr = step.lr,
                         .seconds = step.seconds,
                         .version = st->t->steps_done()};
    c.record_step(out.version, {{"loss", out.loss}, {"kl", out.kl}});
    c.set_activity("idle");
    return out;
  });
  add_policy_save_push(b, st);
}

}  // namespace

void add_grpo_roles(role_registry& roles, grpo_reward_fn reward) {
  TROUPE_CHECK(static_cast<bool>(reward), "add_grpo_roles: no reward function");
  roles.add("grpo_rollout", make_rollout);
  roles.add("grpo_reference", make_reference);
  roles.add("grpo_trainer", make_trainer);
  roles.add("grpo_reward",
            [reward](role_builder& b, role_context& c) { make_reward(b, c, reward); });
}

}  // namespace troupe::actors
