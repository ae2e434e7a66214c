// rl_job_file: the job-file machinery troupe grpo and troupe ppo share (grpo_job.hpp,
// ppo_job.hpp): a TOML file of [section] tables read over a job struct's defaults, each key
// "section.key" set by a typed setter, and every error naming the file (or `origin`) and the key.
// A file over 1 MiB is refused unread and a text with more dots than a job file needs unparsed
// (toml++ makes a table of every part of a dotted key and frees them recursively, so a key of
// 100000 parts overflows the stack; models/train_config.cpp).
#pragma once

#include <toml++/toml.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "memory/error.hpp"

namespace troupe::models {

template <class Job>
using job_setter = std::function<void(Job&, const toml::node&, const std::string& where)>;
template <class Job>
using job_keys = std::map<std::string, job_setter<Job>>;

// A setter of one field (std::string, a floating-point or an integer type; an unsigned one must
// be >= 0). `where` ("section.key") names it in the error.
template <class Job, class Owner, class T>
job_setter<Job> job_field(T Owner::*field) {
  static_assert(std::is_base_of_v<Owner, Job>);
  return [field](Job& c, const toml::node& n, const std::string& where) {
    if constexpr (std::is_same_v<T, std::string>) {
      auto v = n.value_exact<std::string>();
      if (!v) throw error(where + " must be a string");
      c.*field = *v;
    } else if constexpr (std::is_same_v<T, bool>) {
      auto v = n.value_exact<bool>();
      if (!v) throw error(where + " must be true or false");
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

// The text of a job file: refused (naming the file) when over 1 MiB or unreadable.
expected<std::string> read_job_file(const std::string& path);

// Parses `text` into a table and walks it: every [section]'s keys through `keys`; a key not in
// it is refused with unknown_key(name)'s text. Errors are "origin: ..." (a parse error
// "origin:line:column: ..."); `command` ("troupe grpo") names the reader in the dots bound's.
void walk_job_text(std::string_view text, const std::string& origin, std::string_view command,
                   const std::function<bool(const std::string& name, const toml::node&)>& set,
                   const std::function<std::string(const std::string& name)>& unknown_key);

// A job from TOML text: the defaults of Job, the keys set, then Job::validate(); the error names
// `origin`.
template <class Job>
expected<Job> parse_job_text(std::string_view text, const std::string& origin,
                             std::string_view command, const job_keys<Job>& keys,
                             const std::function<std::string(const std::string&)>& unknown_key) {
  Job c;
  try {
    walk_job_text(
        text, origin, command,
        [&](const std::string& name, const toml::node& value) {
          auto it = keys.find(name);
          if (it == keys.end()) return false;
          it->second(c, value, name);
          return true;
        },
        unknown_key);
    c.validate();
  } catch (const error& e) {
    const std::string what = e.what();
    // walk_job_text's own errors already start with the origin.
    return expected<Job>::failure(what.rfind(origin + ":", 0) == 0 ? what : origin + ": " + what);
  }
  return c;
}

// The text of the error for a key of troupe train's job files (train, data, parallel, memory,
// elastic) that `command` does not read, or of any other unknown key. `rows` says what a step's
// rows are instead of train.batch; `sections` lists what the command reads ("[model], [grpo],
// [optim] and [checkpoint]").
std::string rl_unknown_key(const std::string& name, std::string_view command, std::string_view rows,
                           std::string_view sections);

// The checks troupe grpo and troupe ppo share, of their keys under [section] ("grpo", "ppo"):
// the model, the task and its prompts file, the reward, the chat template, the tokenizer, the
// steps and the prompts per step. Throws naming "section.key (--flag)".
template <class Job>
void validate_rl_common(const Job& j, const std::string& section) {
  auto need = [&](bool ok, const std::string& key, const std::string& what) {
    if (!ok) throw error(key + " " + what);
  };
  auto key = [&](const char* name, const char* flag) {
    return section + "." + name + " (--" + flag + ")";
  };
  need(!j.model_size.empty() || !j.model_hf.empty(), "model.size (--model)",
       "must name a size when model.hf is not set");
  need(j.task == "addition" || j.task == "prompts", key("task", "task"),
       "must be \"addition\" or \"prompts\", got '" + j.task + "'");
  need(j.task != "addition" || j.digits == 1 || j.digits == 2, key("digits", "digits"),
       "must be 1 or 2, got " + std::to_string(j.digits));
  need(j.task != "prompts" || !j.prompts_file.empty(), key("prompts_file", "prompts"),
       "is needed by " + section + ".task = \"prompts\"");
  need(j.task == "prompts" || j.prompts_file.empty(), key("prompts_file", "prompts"),
       "is read only by " + section + ".task = \"prompts\" (the task is '" + j.task + "')");
  need(j.reward == "exact" || j.reward == "partial", key("reward", "reward"),
       "must be \"exact\" or \"partial\", got '" + j.reward + "'");
  need(j.chat_template.empty() || j.chat_template == "chatml" || j.chat_template == "llama3",
       key("template", "template"),
       "must be \"\" (raw text), \"chatml\" or \"llama3\", got '" + j.chat_template + "'");
  need(!j.tokenizer.empty(), key("tokenizer", "tokenizer"), "must be byte, gpt2:DIR or spm:FILE");
  need(j.steps > 0, key("steps", "steps"), "must be > 0");
  need(j.prompts_per_step > 0, key("prompts_per_step", "prompts-per-step"), "must be > 0");
  // [parallel]: the policy trainer's plan (the flags over it are checked by the command).
  for (const auto& [value, name] :
       {std::pair{j.dp, "parallel.dp (--dp)"}, std::pair{j.tp, "parallel.tp (--tp)"},
        std::pair{j.pp, "parallel.pp (--pp)"},
        std::pair{j.microbatches, "parallel.microbatches (--microbatches)"}})
    need(value >= 1 && value <= 4096, name, "must be in 1..4096, got " + std::to_string(value));
  need(j.zero >= 0 && j.zero <= 3, "parallel.zero (--zero)",
       "must be 0, 1, 2 or 3, got " + std::to_string(j.zero));
}

}  // namespace troupe::models
