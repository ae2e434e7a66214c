// An actor script with its own elastic policy (issue 17 item 6; actors/elastic_policy.hpp): the
// demo GPT as dp2 x pp2 (2 micro-batches) on 4 ranks with no spare. When a rank is lost, the
// "wait-for-joiner" actor on rank 0 waits up to --wait seconds for a joiner (troupe launch --join)
// to take its place, and else has the run shrink onto its survivors; a joiner that comes later
// grows the run back. Every event the policy hears is printed with "policy:".
//
//   build/apps/troupe launch -n 4 --min-ranks 2 --token T --
//       build/apps/examples/troupe_example_elastic_policy --wait 30 --chaos-kill 3:20:forward
// and, within the 30 s, a joiner (HOST:PORT from the launcher's coordinator line):
//   build/apps/troupe launch --join --coordinator HOST:PORT --token T --
//       build/apps/examples/troupe_example_elastic_policy --wait 30
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "actors/elastic_policy.hpp"
#include "actors/node.hpp"
#include "actors/roles.hpp"
#include "actors/training.hpp"
#include "models/train_config.hpp"

using namespace troupe;

namespace {

std::string ranks_text(const std::vector<int>& ranks) {
  std::string out;
  for (int r : ranks) out += fmt::format("{}{}", out.empty() ? "" : ", ", r);
  return out;
}

// The policy: wait up to `wait` seconds for a joiner, else shrink; grow when one comes.
void add_policy_role(actors::role_registry& roles, double wait) {
  roles.add("wait-for-joiner", [wait](actors::role_builder& b, actors::role_context&) {
    b.on<actors::elastic_event>([wait](actors::role_context&, const actors::elastic_event& e) {
      actors::elastic_decision d;
      if (e.what == "lost" && e.waited < wait) {
        d.action = "wait";
        d.wait_s = wait - e.waited;
        fmt::print(
            "policy: rank {} lost after step {} under {}, no spare: waiting up to {:g} s "
            "for a joiner\n",
            ranks_text(e.ranks), e.step, e.plan, d.wait_s);
      } else if (e.what == "lost") {
        d.action = "shrink";
        fmt::print("policy: no joiner came in {:g} s: shrink {} onto the survivors\n", wait,
                   e.plan);
      } else if (e.what == "joined") {
        d.action = "grow";
        fmt::print("policy: rank {} joined after step {} ({} idle under {}): grow\n",
                   ranks_text(e.ranks), e.step, e.spares, e.plan);
      } else {
        fmt::print("policy: {}: {} on ranks {}\n", e.what, e.plan, ranks_text(e.ranks));
      }
      std::fflush(stdout);
      return d;
    });
  });
}

}  // namespace

int main(int argc, char** argv) {
  models::train_config cfg;  // troupe train's defaults: gpt2-demo on the fortunes corpus
  cfg.steps = 40;
  cfg.batch = 8;
  cfg.seq = 64;
  cfg.plan.dp = 2;
  cfg.plan.pp = 2;
  cfg.plan.microbatches = 2;
  cfg.elastic_enabled = true;
  double wait = 30;
  CLI::App app("An elastic run whose policy is an actor (under troupe launch -n 4 --min-ranks 2)");
  app.add_option("--steps", cfg.steps, "Optimizer steps")->capture_default_str();
  app.add_option("--wait", wait, "Seconds to wait for a joiner before shrinking")
      ->capture_default_str();
  app.add_option("--chaos-kill", cfg.elastic_chaos_kill, "Drill: RANK:STEP:PHASE (troupe train's)");
  app.add_option("--checkpoint-dir", cfg.ckpt_dir, "Where the whole model is written");
  CLI11_PARSE(app, argc, argv);
  // troupe launch --min-ranks M tells its ranks M.
  if (const char* min = std::getenv("TROUPE_MIN_RANKS")) cfg.elastic_min_ranks = std::atoi(min);

  try {
    cfg.validate();
    actors::role_registry roles;
    actors::add_trainer_role(roles);
    add_policy_role(roles, wait);
    actors::node_options o;
    o.roles = &roles;
    o.survive_local_loss = true;  // survivors go on exchanging tensors after a local rank's loss
    actors::node n(o);
    if (n.rank() == 0) {
      actors::drive_options d;
      d.policy_role = "wait-for-joiner";
      d.on_recovery = [](const std::string& line) {
        fmt::print("{}\n", line);
        std::fflush(stdout);
      };
      d.on_step = [](const actors::step_report& r) {
        fmt::print("step {:3d}  loss {:.4f}\n", r.result.step, r.result.loss);
        std::fflush(stdout);
      };
      auto sum = actors::drive_training(n, cfg, d);
      fmt::print("loss {:.3f} -> {:.3f}; {} recoveries, {} joiners, {} growths\n",
                 sum.progress.first_loss, sum.progress.last_loss, sum.recoveries, sum.joiners,
                 sum.growths);
      std::fflush(stdout);
    }
    // A lost rank fails the barrier for those waiting in it; they wait again while rank 0 runs.
    for (int attempt = 0;; ++attempt) {
      try {
        n.barrier("elastic policy: done");
        break;
      } catch (const std::exception&) {
        if (!n.lost_reason(0).empty() || attempt >= n.world_size()) throw;
      }
    }
    n.shutdown();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe_example_elastic_policy: %s\n", e.what());
    return 1;
  }
  return 0;
}
