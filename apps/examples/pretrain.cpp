// An actor script that composes a hybrid-parallel pretraining run in code: a small GPT on the
// fortunes corpus over 4 ranks as 2 data-parallel replicas x 2 pipeline stages (1F1B, 4
// microbatches), ZeRO 1 across the replicas. Every rank registers the "trainer" role; rank 0 is the
// driver: it spawns a trainer per rank, sends them the plan, runs the steps and prints what they
// report, then writes the whole model in HF layout and prints a few lines sampled from it.
//
//   build/apps/troupe launch -n 4 -- build/apps/examples/troupe_example_pretrain [--steps N] [--tp]
//
// (--tp: 2 data-parallel replicas x 2 tensor shards with sequence parallelism instead.) The run is
// the single-process `troupe train --steps N --batch 8 --seq 64 --warmup 10` split over the ranks:
// same losses, and its checkpoint resumes there (--resume) or under any other plan.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "actors/node.hpp"
#include "actors/roles.hpp"
#include "actors/training.hpp"
#include "apps/sample_text.hpp"
#include "models/train_config.hpp"

using namespace troupe;

int main(int argc, char** argv) {
  // The run: the defaults of troupe train (gpt2-demo on /usr/share/games/fortunes) and a plan.
  models::train_config cfg;
  cfg.steps = 60;
  cfg.batch = 8;  // sequences per step, split over the replicas and the microbatches
  cfg.seq = 64;
  cfg.warmup = 10;
  cfg.ckpt_dir = "/tmp/troupe-pretrain-example";
  cfg.plan.dp = 2;
  cfg.plan.pp = 2;
  cfg.plan.zero = 1;
  cfg.plan.microbatches = 4;
  cfg.plan.schedule = scheduler::schedule_kind::one_f_one_b;
  bool tp = false;
  int log_every = 10;
  apps::sample_options sample;
  sample.seed = cfg.seed;

  CLI::App app("A hybrid-parallel pretraining run composed in code (under troupe launch -n 4)");
  app.add_option("--steps", cfg.steps, "Optimizer steps")->capture_default_str();
  app.add_flag("--tp", tp, "dp 2 x tp 2 with sequence parallelism instead of dp 2 x pp 2");
  app.add_option("--checkpoint-dir", cfg.ckpt_dir, "Where the whole model is written")
      ->capture_default_str();
  app.add_option("--log-every", log_every, "Steps between log lines")->capture_default_str();
  app.add_option("--sample", sample.tokens, "Tokens to generate at the end (0: none)")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (tp) {
    cfg.plan.pp = 1;
    cfg.plan.tp = 2;
    cfg.plan.sp = true;
    cfg.plan.microbatches = 1;
  }

  try {
    cfg.validate();
    actors::role_registry roles;
    actors::add_trainer_role(roles);  // every rank hosts a trainer actor
    actors::node_options o;
    o.roles = &roles;
    actors::node n(o);    // joins the job troupe launch started
    if (n.rank() == 0) {  // the driver
      fmt::print("plan: {}\n", scheduler::describe(cfg.plan));
      actors::drive_options d;
      d.on_setup = [](const std::vector<std::string>& ranks) {
        for (const auto& r : ranks) fmt::print("  {}\n", r);
      };
      d.on_step = [&](const actors::step_report& r) {
        if (r.result.step % log_every == 0 || r.result.step == 1)
          fmt::print("step {:3d}  loss {:.4f}  {:.0f} tokens/s  bubble {:.0f}%\n", r.result.step,
                     r.result.loss, r.result.tokens / r.result.seconds, 100 * r.bubble);
        std::fflush(stdout);
      };
      auto sum = actors::drive_training(n, cfg, d);
      fmt::print("loss {:.3f} -> {:.3f} in {:.1f} s; whole model written to {}\n",
                 sum.progress.first_loss, sum.progress.last_loss, sum.progress.seconds,
                 sum.checkpoint);
      if (sample.tokens > 0 && !sum.checkpoint.empty())
        fmt::print("sample from the checkpoint ({}):\n{}\n", apps::sample_settings,
                   apps::sample_checkpoint(sum.checkpoint, cfg.seq, sample));
      std::fflush(stdout);
    }
    n.barrier("pretrain: done");  // the other ranks wait here while rank 0 samples
    n.shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_example_pretrain: %s\n", e.what());
    return 1;
  }
  return 0;
}
