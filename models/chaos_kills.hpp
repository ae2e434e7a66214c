// elastic.chaos_kill (--chaos-kill) with several entries: "1:5:forward,3:12:replicate" kills rank 1
// before its forward pass of step 5 and rank 3 during the buddy copy after step 12, each once (the
// process ends). The drill's phases, in the order a step reaches them (actors/training.cpp):
//   forward    before its forward pass (the step's prepare)
//   backward   at its first gradient reduction on its dp group, issued from the backward pass
//              after the forward (dp 1: once its backward and clipping are done), before the
//              gradient collectives complete
//   commit     every rank prepared the step, before its optimizer step
//   optimizer  its AdamW of the commit has run (its state changed), before its reply
//   replicate  during the buddy copy after step STEP (elastic.replica_interval): its parameters
//              went to its buddy and its left neighbour's came in, its moments not yet
#pragma once

#include <optional>
#include <string_view>
#include <vector>

#include "models/train_config.hpp"

namespace troupe::models {

inline constexpr const char* chaos_phases[] = {"forward", "backward", "commit", "optimizer",
                                               "replicate"};

// The entries of elastic.chaos_kill, comma-separated; nullopt when any is malformed (an empty
// text too).
std::optional<std::vector<chaos_kill>> parse_chaos_kills(std::string_view text);

}  // namespace troupe::models
