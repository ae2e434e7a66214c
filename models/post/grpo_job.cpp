// grpo_job: troupe grpo's job file (grpo_job.hpp).
#include "models/post/grpo_job.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

namespace troupe::models {
namespace {

constexpr std::uintmax_t max_job_file_bytes = 1 << 20;
// toml++ makes a table of every part of a dotted key and frees them recursively, so a key of
// 100000 parts overflows the stack (models/train_config.cpp). This file's keys have two parts and
// its values few dots (numbers, paths): a text with more dots than this is refused unparsed.
constexpr std::size_t max_dots = 4096;

using setter = std::function<void(grpo_job&, const toml::node&, const std::string& where)>;

template <class T>
setter set(T grpo_job::*field) {
  return [field](grpo_job& c, const toml::node& n, const std::string& where) {
    if constexpr (std::is_same_v<T, std::string>) {
      auto v = n.value_exact<std::string>();
      if (!v) throw error(where + " must be a string");
      c.*field = *v;
    } else if constexpr (std::is_floating_point_v<T>) {
      auto v = n.value<double>();
      if (!v || n.is_boolean()) throw error(where + " must be a number");
      c.*field = static_cast<T>(*v);
    } else {
      auto v = n.value_exact<std::int64_t>();
      if (!v || (std::is_unsigned_v<T> && *v < 0))
        throw error(where + " must be an integer" + (std::is_unsigned_v<T> ? " >= 0" : ""));
      c.*field = static_cast<T>(*v);
    }
  };
}

const std::map<std::string, setter>& setters() {
  static const std::map<std::string, setter> s = {
      {"model.hf", set(&grpo_job::model_hf)},
      {"model.size", set(&grpo_job::model_size)},
      {"grpo.task", set(&grpo_job::task)},
      {"grpo.digits", set(&grpo_job::digits)},
      {"grpo.prompts_file", set(&grpo_job::prompts_file)},
      {"grpo.reward", set(&grpo_job::reward)},
      {"grpo.template", set(&grpo_job::chat_template)},
      {"grpo.tokenizer", set(&grpo_job::tokenizer)},
      {"grpo.steps", set(&grpo_job::steps)},
      {"grpo.prompts_per_step", set(&grpo_job::prompts_per_step)},
      {"grpo.group", set(&grpo_job::group)},
      {"grpo.max_new_tokens", set(&grpo_job::max_new_tokens)},
      {"grpo.temperature", set(&grpo_job::temperature)},
      {"grpo.top_p", set(&grpo_job::top_p)},
      {"grpo.kl_coef", set(&grpo_job::kl_coef)},
      {"grpo.clip_epsilon", set(&grpo_job::clip_epsilon)},
      {"grpo.seed", set(&grpo_job::seed)},
      {"grpo.rollouts", set(&grpo_job::rollouts)},
      {"grpo.staleness", set(&grpo_job::staleness)},
      {"grpo.log_every", set(&grpo_job::log_every)},
      {"optim.lr", set(&grpo_job::lr)},
      {"optim.warmup", set(&grpo_job::warmup)},
      {"optim.weight_decay", set(&grpo_job::weight_decay)},
      {"optim.clip", set(&grpo_job::clip)},
      {"optim.beta1", set(&grpo_job::beta1)},
      {"optim.beta2", set(&grpo_job::beta2)},
      {"checkpoint.dir", set(&grpo_job::ckpt_dir)},
      {"checkpoint.every", set(&grpo_job::ckpt_every)},
  };
  return s;
}

// What a key troupe train knows but GRPO does not read is, in the error.
std::string unknown_key(const std::string& name) {
  const auto dot = name.find('.');
  const std::string section = name.substr(0, dot);
  if (section == "train" || section == "data" || section == "parallel" || section == "memory" ||
      section == "elastic")
    return "'" + name +
           "' is a key of troupe train's job files that troupe grpo does not read (its rows are "
           "grpo.prompts_per_step x grpo.group; its settings are [model], [grpo], [optim] and "
           "[checkpoint])";
  return "unknown key '" + name + "' (troupe grpo reads [model], [grpo], [optim], [checkpoint])";
}

expected<grpo_job> from_table(const toml::table& doc, const std::string& origin) {
  grpo_job c;
  try {
    for (const auto& [section, node] : doc) {
      const auto* tbl = node.as_table();
      if (tbl == nullptr) throw error("'" + std::string(section.str()) + "' must be a [section]");
      for (const auto& [key, value] : *tbl) {
        const std::string name = std::string(section.str()) + "." + std::string(key.str());
        auto it = setters().find(name);
        if (it == setters().end()) throw error(unknown_key(name));
        it->second(c, value, name);
      }
    }
    c.validate();
  } catch (const error& e) {
    return expected<grpo_job>::failure(origin + ": " + e.what());
  }
  return c;
}

}  // namespace

void grpo_job::validate() const {
  auto need = [](bool ok, const char* key, const std::string& what) {
    if (!ok) throw error(std::string(key) + " " + what);
  };
  need(!model_size.empty() || !model_hf.empty(), "model.size (--model)",
       "must name a size when model.hf is not set");
  need(task == "addition" || task == "prompts", "grpo.task (--task)",
       "must be \"addition\" or \"prompts\", got '" + task + "'");
  need(task != "addition" || digits == 1 || digits == 2, "grpo.digits (--digits)",
       "must be 1 or 2, got " + std::to_string(digits));
  need(task != "prompts" || !prompts_file.empty(), "grpo.prompts_file (--prompts)",
       "is needed by grpo.task = \"prompts\"");
  need(task == "prompts" || prompts_file.empty(), "grpo.prompts_file (--prompts)",
       "is read only by grpo.task = \"prompts\" (the task is '" + task + "')");
  need(reward == "exact" || reward == "partial", "grpo.reward (--reward)",
       "must be \"exact\" or \"partial\", got '" + reward + "'");
  need(chat_template.empty() || chat_template == "chatml" || chat_template == "llama3",
       "grpo.template (--template)",
       "must be \"\" (raw text), \"chatml\" or \"llama3\", got '" + chat_template + "'");
  need(!tokenizer.empty(), "grpo.tokenizer (--tokenizer)", "must be byte, gpt2:DIR or spm:FILE");
  need(steps > 0, "grpo.steps (--steps)", "must be > 0");
  need(prompts_per_step > 0, "grpo.prompts_per_step (--prompts-per-step)", "must be > 0");
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
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > max_job_file_bytes)
    return expected<grpo_job>::failure(path + ": " + std::to_string(size) +
                                       " bytes, more than the 1 MiB bound for a job file " +
                                       "(refused unread)");
  std::ifstream in(path, std::ios::binary);
  if (!in) return expected<grpo_job>::failure(path + ": cannot open it: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return expected<grpo_job>::failure(path + ": cannot read it");
  return parse_grpo_job(text.str(), path);
}

expected<grpo_job> parse_grpo_job(std::string_view text, const std::string& origin) {
  if (const auto dots = static_cast<std::size_t>(std::count(text.begin(), text.end(), '.'));
      dots > max_dots)
    return expected<grpo_job>::failure(origin + ": " + std::to_string(dots) +
                                       " dots, more than a troupe grpo job file needs (" +
                                       std::to_string(max_dots) + "; refused unparsed)");
  try {
    return from_table(toml::parse(text, origin), origin);
  } catch (const toml::parse_error& e) {
    std::ostringstream os;
    os << origin << ":" << e.source().begin.line << ":" << e.source().begin.column << ": "
       << e.description();
    return expected<grpo_job>::failure(os.str());
  }
}

}  // namespace troupe::models
