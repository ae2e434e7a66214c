// post_launched: one rank of a launched post-training run (troupe sft, troupe dpo under
// `troupe launch -n N` with troupe train's plan flags). Every rank builds the same samples from the
// same file and settings (a pure function of them); rank 0 drives the trainer actors of every rank
// through troupe train's driver (actors/training.hpp: drive_training), which step
// hybrid_trainer on those samples and save the plan checkpoint (HF layout) when asked.
#pragma once

#include <fmt/core.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "actors/node.hpp"
#include "actors/training.hpp"
#include "apps/post_run.hpp"
#include "memory/error.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/train_loop.hpp"
#include "scheduler/plan.hpp"

namespace troupe::apps {

// What no launched post-training run does yet, refused by name before any rank joins.
inline void refuse_unlaunchable(const char* command, const models::train_config& cfg) {
  const auto& p = cfg.plan;
  TROUPE_CHECK(p.cp == 1, "troupe ", command, ": parallel.cp (--cp) ", p.cp,
               ": context parallelism is not supported for post-training yet");
  TROUPE_CHECK(p.ep == 1, "troupe ", command, ": parallel.ep (--ep) ", p.ep,
               ": expert parallelism is not supported for post-training yet");
  TROUPE_CHECK(cfg.precision != "f64", "troupe ", command, ": train.precision (--precision) ",
               cfg.precision, " under troupe launch: launched post-training runs in f32, bf16 or ",
               "f16 (f64, the reference twin: one process)");
  TROUPE_CHECK(!cfg.elastic(), "troupe ", command,
               ": elastic runs (elastic.enabled, elastic.spares) are not supported for "
               "post-training yet");
}

// A plan of several ranks started in one process: refused, saying how to start it.
inline void refuse_plan_in_one_process(const char* command, const models::train_config& cfg) {
  TROUPE_CHECK(cfg.plan.world_size() == 1, "troupe ", command,
               ": parallel.dp x parallel.pp x parallel.tp = ", cfg.plan.world_size(),
               " ranks: start them with `troupe launch -n ", cfg.plan.world_size(), " -- troupe ",
               command, " ...`");
}

// --json's line of a step (the single-process commands' keys: step, loss, grad_norm, lr).
inline void print_json_step(std::FILE* json, const models::step_result& r) {
  if (json != nullptr)
    fmt::print(json, "{{\"step\": {}, \"loss\": {}, \"grad_norm\": {}, \"lr\": {:.6g}}}\n", r.step,
               r.loss, r.grad_norm, r.lr);
}

// Runs this rank: `header` (rank 0's lines before the setup) and the trainers' samples.
inline int run_post_launched(const post_cli& c, const post_setup& s, const char* command,
                             const std::string& header, actors::trainer_samples samples) {
  actors::role_registry roles;
  actors::add_trainer_role(roles, std::move(samples));
  actors::node_options no;
  no.roles = &roles;
  actors::node n(no);
  if (n.rank() == 0) {
    fmt::print("troupe {}: {} on {} ranks: {}, template {}, tokenizer {}\n{}\n", command, s.label,
               n.world_size(), scheduler::describe(s.cfg.plan), c.chat_template, s.tok->name(),
               header);
    auto json = open_post_json(c.json_path);
    actors::drive_options d;
    d.on_setup = [](const std::vector<std::string>& ranks) {
      for (const auto& r : ranks) fmt::print("  {}\n", r);
      std::fflush(stdout);
    };
    double tokens = 0, seconds = 0;
    d.on_step = [&](const actors::step_report& rep) {
      const auto& r = rep.result;
      print_json_step(json.get(), r);
      tokens += r.tokens;
      seconds += r.seconds;
      if (r.step % s.cfg.log_every == 0 || r.step == s.cfg.steps || r.step == 1)
        fmt::print("step {:5d}/{}  loss {:.4f}  grad norm {:.3f}  lr {:.2e}  {:.0f} tokens/s\n",
                   r.step, s.cfg.steps, r.loss, r.grad_norm, r.lr,
                   tokens / std::max(seconds, 1e-9));
      std::fflush(stdout);
    };
    d.on_save = [](std::int64_t step, const std::string& dir, std::optional<std::int64_t> held) {
      fmt::print("{}\n", models::hf::saved_line(dir, step, held));
      std::fflush(stdout);
    };
    const auto sum = actors::drive_training(n, s.cfg, d);
    fmt::print("{}\n", models::trained_line(sum.progress));
    if (!sum.checkpoint.empty())
      fmt::print("checkpoint: {} (HF layout; troupe generate --model {})\n", sum.checkpoint,
                 sum.checkpoint);
    std::fflush(stdout);
  }
  n.barrier(fmt::format("troupe {}: done", command));
  n.shutdown();
  return 0;
}

}  // namespace troupe::apps
