// ppo_job: troupe ppo's job file (ppo_job.hpp).
#include "models/post/ppo_job.hpp"

#include "models/post/rl_job_file.hpp"

namespace troupe::models {
namespace {

template <class T>
job_setter<ppo_job> set(T ppo_job::*field) {
  return job_field<ppo_job>(field);
}

const job_keys<ppo_job>& keys() {
  static const job_keys<ppo_job> s = {
      {"model.hf", set(&ppo_job::model_hf)},
      {"model.size", set(&ppo_job::model_size)},
      {"ppo.task", set(&ppo_job::task)},
      {"ppo.digits", set(&ppo_job::digits)},
      {"ppo.prompts_file", set(&ppo_job::prompts_file)},
      {"ppo.reward", set(&ppo_job::reward)},
      {"ppo.template", set(&ppo_job::chat_template)},
      {"ppo.tokenizer", set(&ppo_job::tokenizer)},
      {"ppo.steps", set(&ppo_job::steps)},
      {"ppo.prompts_per_step", set(&ppo_job::prompts_per_step)},
      {"ppo.samples_per_prompt", set(&ppo_job::group)},
      {"ppo.max_new_tokens", set(&ppo_job::max_new_tokens)},
      {"ppo.temperature", set(&ppo_job::temperature)},
      {"ppo.top_p", set(&ppo_job::top_p)},
      {"ppo.seed", set(&ppo_job::seed)},
      {"ppo.rollouts", set(&ppo_job::rollouts)},
      {"ppo.staleness", set(&ppo_job::staleness)},
      {"ppo.log_every", set(&ppo_job::log_every)},
      {"ppo.epochs", set(&ppo_job::epochs)},
      {"ppo.kl_coef", set(&ppo_job::kl_coef)},
      {"ppo.kl_estimator", set(&ppo_job::kl_estimator)},
      {"ppo.whiten_rewards", set(&ppo_job::whiten_rewards)},
      {"ppo.gamma", set(&ppo_job::gamma)},
      {"ppo.lam", set(&ppo_job::lam)},
      {"ppo.cliprange", set(&ppo_job::cliprange)},
      {"ppo.cliprange_value", set(&ppo_job::cliprange_value)},
      {"ppo.vf_coef", set(&ppo_job::vf_coef)},
      {"critic.hf", set(&ppo_job::critic_hf)},
      {"critic.lr", set(&ppo_job::critic_lr)},
      {"optim.lr", set(&ppo_job::lr)},
      {"optim.warmup", set(&ppo_job::warmup)},
      {"optim.weight_decay", set(&ppo_job::weight_decay)},
      {"optim.clip", set(&ppo_job::clip)},
      {"optim.beta1", set(&ppo_job::beta1)},
      {"optim.beta2", set(&ppo_job::beta2)},
      {"checkpoint.dir", set(&ppo_job::ckpt_dir)},
      {"checkpoint.critic_dir", set(&ppo_job::critic_ckpt_dir)},
      {"checkpoint.every", set(&ppo_job::ckpt_every)},
      {"parallel.dp", set(&ppo_job::dp)},
      {"parallel.tp", set(&ppo_job::tp)},
      {"parallel.pp", set(&ppo_job::pp)},
      {"parallel.zero", set(&ppo_job::zero)},
      {"parallel.microbatches", set(&ppo_job::microbatches)},
      {"parallel.sp", set(&ppo_job::sp)},
  };
  return s;
}

std::string unknown_key(const std::string& name) {
  return rl_unknown_key(name, "troupe ppo", "ppo.prompts_per_step x ppo.samples_per_prompt",
                        "[model], [ppo], [critic], [optim], [checkpoint] and [parallel]");
}

}  // namespace

std::string ppo_job::critic_dir() const {
  if (!critic_ckpt_dir.empty()) return critic_ckpt_dir;
  return ckpt_dir.empty() ? std::string() : ckpt_dir + "-critic";
}

void ppo_job::validate() const {
  auto need = [](bool ok, const char* key, const std::string& what) {
    if (!ok) throw error(std::string(key) + " " + what);
  };
  validate_rl_common(*this, "ppo");
  need(group > 0, "ppo.samples_per_prompt (--samples-per-prompt)",
       "must be > 0, got " + std::to_string(group));
  need(max_new_tokens > 0, "ppo.max_new_tokens (--max-new-tokens)", "must be > 0");
  need(temperature > 0, "ppo.temperature (--temperature)", "must be > 0");
  need(top_p > 0 && top_p <= 1, "ppo.top_p (--top-p)", "must be in (0, 1]");
  need(rollouts > 0 && rollouts <= 64, "ppo.rollouts (--rollouts)", "must be in 1..64");
  need(prompts_per_step % rollouts == 0, "ppo.prompts_per_step (--prompts-per-step)",
       "must be a multiple of ppo.rollouts (" + std::to_string(rollouts) +
           "): the rollout actors split each step's prompts evenly");
  need(staleness == 0 || staleness == 1, "ppo.staleness (--staleness)",
       "must be 0 (sync) or 1 (async, one step behind)");
  need(log_every > 0, "ppo.log_every (--log-every)", "must be > 0");
  need(epochs > 0, "ppo.epochs (--epochs)", "must be > 0");
  need(kl_coef >= 0, "ppo.kl_coef (--kl-coef)", "must be >= 0 (0: no reference model)");
  need(kl_estimator == "k1" || kl_estimator == "k3", "ppo.kl_estimator (--kl-estimator)",
       "must be \"k1\" or \"k3\", got '" + kl_estimator + "'");
  need(gamma > 0 && gamma <= 1, "ppo.gamma (--gamma)", "must be in (0, 1]");
  need(lam >= 0 && lam <= 1, "ppo.lam (--lam)", "must be in [0, 1]");
  need(cliprange > 0 && cliprange < 1, "ppo.cliprange (--cliprange)", "must be in (0, 1)");
  need(cliprange_value > 0, "ppo.cliprange_value (--cliprange-value)", "must be > 0");
  need(vf_coef > 0, "ppo.vf_coef (--vf-coef)", "must be > 0");
  need(critic_lr > 0, "critic.lr (--critic-lr)", "must be > 0");
  need(lr > 0, "optim.lr (--lr)", "must be > 0");
  need(warmup >= 0, "optim.warmup (--warmup)", "must be >= 0");
  need(weight_decay >= 0, "optim.weight_decay (--weight-decay)", "must be >= 0");
  need(clip >= 0, "optim.clip (--clip)", "must be >= 0 (0: no clipping)");
  need(beta1 >= 0 && beta1 < 1, "optim.beta1", "must be in [0, 1)");
  need(beta2 >= 0 && beta2 < 1, "optim.beta2", "must be in [0, 1)");
  need(ckpt_every >= 0, "checkpoint.every (--checkpoint-every)", "must be >= 0");
  need(ckpt_every == 0 || !ckpt_dir.empty(), "checkpoint.every (--checkpoint-every)",
       "needs checkpoint.dir (--checkpoint-dir)");
  need(critic_ckpt_dir.empty() || !ckpt_dir.empty(),
       "checkpoint.critic_dir (--critic-checkpoint-dir)",
       "needs checkpoint.dir (--checkpoint-dir)");
  need(critic_dir().empty() || critic_dir() != ckpt_dir,
       "checkpoint.critic_dir (--critic-checkpoint-dir)",
       "must differ from checkpoint.dir (each save replaces its folder)");
}

expected<ppo_job> load_ppo_job(const std::string& path) {
  auto text = read_job_file(path);
  if (!text) return expected<ppo_job>::failure(text.error_message());
  return parse_ppo_job(*text, path);
}

expected<ppo_job> parse_ppo_job(std::string_view text, const std::string& origin) {
  return parse_job_text<ppo_job>(text, origin, "troupe ppo", keys(), unknown_key);
}

}  // namespace troupe::models
