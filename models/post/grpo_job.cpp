// grpo_job: troupe grpo's job file (grpo_job.hpp), read by the machinery troupe ppo shares
// (rl_job_file.hpp).
#include "models/post/grpo_job.hpp"

#include "models/post/rl_job_file.hpp"

namespace troupe::models {
namespace {

const job_keys<grpo_job>& keys() {
  static const job_keys<grpo_job> s = {
      {"model.hf", job_field<grpo_job>(&grpo_job::model_hf)},
      {"model.size", job_field<grpo_job>(&grpo_job::model_size)},
      {"grpo.task", job_field<grpo_job>(&grpo_job::task)},
      {"grpo.digits", job_field<grpo_job>(&grpo_job::digits)},
      {"grpo.prompts_file", job_field<grpo_job>(&grpo_job::prompts_file)},
      {"grpo.reward", job_field<grpo_job>(&grpo_job::reward)},
      {"grpo.template", job_field<grpo_job>(&grpo_job::chat_template)},
      {"grpo.tokenizer", job_field<grpo_job>(&grpo_job::tokenizer)},
      {"grpo.steps", job_field<grpo_job>(&grpo_job::steps)},
      {"grpo.prompts_per_step", job_field<grpo_job>(&grpo_job::prompts_per_step)},
      {"grpo.group", job_field<grpo_job>(&grpo_job::group)},
      {"grpo.max_new_tokens", job_field<grpo_job>(&grpo_job::max_new_tokens)},
      {"grpo.temperature", job_field<grpo_job>(&grpo_job::temperature)},
      {"grpo.top_p", job_field<grpo_job>(&grpo_job::top_p)},
      {"grpo.kl_coef", job_field<grpo_job>(&grpo_job::kl_coef)},
      {"grpo.clip_epsilon", job_field<grpo_job>(&grpo_job::clip_epsilon)},
      {"grpo.seed", job_field<grpo_job>(&grpo_job::seed)},
      {"grpo.rollouts", job_field<grpo_job>(&grpo_job::rollouts)},
      {"grpo.staleness", job_field<grpo_job>(&grpo_job::staleness)},
      {"grpo.log_every", job_field<grpo_job>(&grpo_job::log_every)},
      {"optim.lr", job_field<grpo_job>(&grpo_job::lr)},
      {"optim.warmup", job_field<grpo_job>(&grpo_job::warmup)},
      {"optim.weight_decay", job_field<grpo_job>(&grpo_job::weight_decay)},
      {"optim.clip", job_field<grpo_job>(&grpo_job::clip)},
      {"optim.beta1", job_field<grpo_job>(&grpo_job::beta1)},
      {"optim.beta2", job_field<grpo_job>(&grpo_job::beta2)},
      {"checkpoint.dir", job_field<grpo_job>(&grpo_job::ckpt_dir)},
      {"checkpoint.every", job_field<grpo_job>(&grpo_job::ckpt_every)},
      {"parallel.dp", job_field<grpo_job>(&grpo_job::dp)},
      {"parallel.tp", job_field<grpo_job>(&grpo_job::tp)},
      {"parallel.pp", job_field<grpo_job>(&grpo_job::pp)},
      {"parallel.zero", job_field<grpo_job>(&grpo_job::zero)},
      {"parallel.microbatches", job_field<grpo_job>(&grpo_job::microbatches)},
      {"parallel.sp", job_field<grpo_job>(&grpo_job::sp)},
  };
  return s;
}

std::string unknown_key(const std::string& name) {
  return rl_unknown_key(name, "troupe grpo", "grpo.prompts_per_step x grpo.group",
                        "[model], [grpo], [optim], [checkpoint] and [parallel] (dp, tp, pp, zero, "
                        "microbatches, sp)");
}

}  // namespace

void grpo_job::validate() const {
  auto need = [](bool ok, const char* key, const std::string& what) {
    if (!ok) throw error(std::string(key) + " " + what);
  };
  validate_rl_common(*this, "grpo");
  need(group > 1, "grpo.group (--group)",
       "must be > 1 (the advantages are normalised over each prompt's group), got " +
           std::to_string(group));
  need(max_new_tokens > 0, "grpo.max_new_tokens (--max-new-tokens)", "must be > 0");
  need(temperature > 0, "grpo.temperature (--temperature)", "must be > 0");
  need(top_p > 0 && top_p <= 1, "grpo.top_p (--top-p)", "must be in (0, 1]");
  need(kl_coef >= 0, "grpo.kl_coef (--kl-coef)", "must be >= 0 (0: no reference model)");
  need(clip_epsilon > 0 && clip_epsilon < 1, "grpo.clip_epsilon (--clip-epsilon)",
       "must be in (0, 1)");
  need(rollouts > 0 && rollouts <= 64, "grpo.rollouts (--rollouts)", "must be in 1..64");
  need(prompts_per_step % rollouts == 0, "grpo.prompts_per_step (--prompts-per-step)",
       "must be a multiple of grpo.rollouts (" + std::to_string(rollouts) +
           "): the rollout actors split each step's prompts evenly");
  need(staleness == 0 || staleness == 1, "grpo.staleness (--staleness)",
       "must be 0 (sync) or 1 (async, one step behind)");
  need(log_every > 0, "grpo.log_every (--log-every)", "must be > 0");
  need(lr > 0, "optim.lr (--lr)", "must be > 0");
  need(warmup >= 0, "optim.warmup (--warmup)", "must be >= 0");
  need(weight_decay >= 0, "optim.weight_decay (--weight-decay)", "must be >= 0");
  need(clip >= 0, "optim.clip (--clip)", "must be >= 0 (0: no clipping)");
  need(beta1 >= 0 && beta1 < 1, "optim.beta1", "must be in [0, 1)");
  need(beta2 >= 0 && beta2 < 1, "optim.beta2", "must be in [0, 1)");
  need(ckpt_every >= 0, "checkpoint.every (--checkpoint-every)", "must be >= 0");
  need(ckpt_every == 0 || !ckpt_dir.empty(), "checkpoint.every (--checkpoint-every)",
       "needs checkpoint.dir (--checkpoint-dir)");
}

expected<grpo_job> load_grpo_job(const std::string& path) {
  auto text = read_job_file(path);
  if (!text) return expected<grpo_job>::failure(text.error_message());
  return parse_grpo_job(*text, path);
}

expected<grpo_job> parse_grpo_job(std::string_view text, const std::string& origin) {
  return parse_job_text<grpo_job>(text, origin, "troupe grpo", keys(), unknown_key);
}

}  // namespace troupe::models
