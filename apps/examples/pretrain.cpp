// An actor script that composes a hybrid-parallel pretraining run in code: a small GPT on the
// fortunes corpus over 4 ranks as 2 data-parallel replicas x 2 pipeline stages (1F1B, 4
// microbatches), ZeRO 1 across the replicas. Every rank registers the "trainer" role; rank 0 is the
// driver: it spawns a trainer per rank, sends them the plan, runs the steps and prints what they
// report, then writes the whole model in HF layout.
//
//   build/apps/troupe launch -n 4 -- build/apps/examples/troupe_example_pretrain [--steps N] [--tp]
//
// (--tp: 2 data-parallel replicas x 2 tensor shards with sequence parallelism instead.)
#include <fmt/core.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "actors/node.hpp"
#include "actors/roles.hpp"
#include "actors/training.hpp"
#include "models/train_config.hpp"

using namespace troupe;

int main(int argc, char** argv) {
  models::train_config cfg;  // the defaults: gpt2-demo on /usr/share/games/fortunes
  cfg.steps = 60;
  cfg.batch = 8;
  cfg.seq = 64;
  cfg.warmup = 10;
  cfg.ckpt_dir = "/tmp/troupe-pretrain-example";
  cfg.plan.dp = 2;
  cfg.plan.pp = 2;
  cfg.plan.zero = 1;
  cfg.plan.microbatches = 4;
  cfg.plan.schedule = scheduler::schedule_kind::one_f_one_b;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      cfg.steps = std::atoi(argv[++i]);
    } else if (std::strcmp(argv[i], "--tp") == 0) {
      cfg.plan.pp = 1;
      cfg.plan.tp = 2;
      cfg.plan.sp = true;
      cfg.plan.microbatches = 1;
    } else {
      std::fprintf(stderr, "troupe_example_pretrain: unknown argument '%s' (--steps N, --tp)\n",
                   argv[i]);
      return 2;
    }
  }
  try {
    actors::role_registry roles;
    actors::add_trainer_role(roles);
    actors::node_options o;
    o.roles = &roles;
    actors::node n(o);
    if (n.rank() == 0) {
      fmt::print("plan: {}\n", scheduler::describe(cfg.plan));
      actors::drive_options d;
      d.on_setup = [](const std::vector<std::string>& ranks) {
        for (const auto& r : ranks) fmt::print("  {}\n", r);
      };
      d.on_step = [&](const actors::step_report& r) {
        if (r.result.step % 10 == 0 || r.result.step == 1)
          fmt::print("step {:3d}  loss {:.4f}  {:.0f} tokens/s  bubble {:.0f}%\n", r.result.step,
                     r.result.loss, r.result.tokens / r.result.seconds, 100 * r.bubble);
        std::fflush(stdout);
      };
      auto sum = actors::drive_training(n, cfg, d);
      fmt::print("loss {:.3f} -> {:.3f} in {:.1f} s; whole model written to {}\n", sum.first_loss,
                 sum.last_loss, sum.seconds, sum.checkpoint);
    }
    n.barrier("pretrain: done");
    n.shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_example_pretrain: %s\n", e.what());
    return 1;
  }
  return 0;
}
