// The "expert-group" role: in a launched run with expert parallelism (parallel.ep > 1,
// models/parallel/expert_parallel.hpp) one expert-group actor per rank stands for the experts that
// rank holds - its expert group: experts [first, first + count) of every MoE layer, at
// expert-parallel rank `ep` of its group and expert-data-parallel rank `edp`. drive_training
// spawns them beside the trainers and hands each trainer its rank's; after every step the trainer
// tells it the step's load (expert_load_report, from ep_trainer::last_load), and the actor shows
// it to introspection (`troupe ps` / `troupe top`, the endpoint's /json, /metrics and dashboard)
// as metrics and per-step series (expert_load_values).
//
// The experts' compute stays in the trainer's engine (one step is one forward and backward of the
// rank's whole piece); the expert group owns what is said about them.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "actors/roles.hpp"

namespace troupe::actors {

// One step's load of one rank's expert group.
struct expert_load_report {
  std::int64_t step = 0;  // 1-based: steps done
  std::int32_t dp = 0, ep = 0, edp = 0;
  std::int32_t first_expert = 0;
  // Per expert of the model (every expert, global index): the job's top-k choices of it over the
  // layers and microbatches of the step (the same on every rank).
  std::vector<std::int64_t> tokens;
  // Per expert of this group (first_expert, ...): the rows it computed, sent by every rank of its
  // expert-parallel group.
  std::vector<std::int64_t> served;
  std::int64_t dropped = 0;  // choices over capacity (dropless: 0)
  double imbalance = 0;      // the most loaded expert's tokens over the mean (1: balanced)
  double all_to_all_s = 0;   // this rank's seconds in the MoE all-to-alls during the step
  double compute_s = 0;      // the step's seconds up to the gradient reduction
  auto fields() {
    return std::tie(step, dp, ep, edp, first_expert, tokens, served, dropped, imbalance,
                    all_to_all_s, compute_s);
  }
};
struct expert_load_ack {
  std::int64_t step = 0;
  auto fields() { return std::tie(step); }
};

// The metrics of one report: "experts.first", "experts.count", "tokens.expert<e>" (the job's
// choices of each of the group's experts), "served.expert<e>", "tokens.group" (their sum),
// "dropped", "imbalance", "all_to_all_s", "all_to_all_share" (of compute_s). Fails naming the
// field when the report does not hold together (its experts beyond the model's).
std::map<std::string, double> expert_load_values(const expert_load_report& r);

// Registers the "expert-group" role (add_trainer_role does, for drive_training).
void add_expert_group_role(role_registry& roles);

}  // namespace troupe::actors
