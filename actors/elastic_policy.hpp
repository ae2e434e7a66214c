// Custom policies of elastic runs (issue 17 item 6; docs/adr/0005, section 12): an actor script
// registers a role whose actor answers elastic_event requests with an elastic_decision, and names
// it in drive_options::policy_role. The driver spawns that actor on its own rank and asks it:
//
//   "lost"       ranks holding grid positions were lost and no spare is left; `waited` says how
//                long it has waited for a joiner so far. Decisions: "wait" (wait up to wait_s more
//                seconds for a joiner, troupe launch --join, to take the place; then it asks
//                again), "shrink" (onto the survivors, down to elastic.min_ranks), "end" (the run
//                ends as without a way on: a surviving replica saves the last committed step),
//                "default" (what the settings say: elastic.join_wait, then min_ranks).
//   "joined"     a joiner became a spare at a step boundary. "grow" or "default": grow back to
//                the larger plan now if the idle ranks allow it; "stay": keep the plan (asked
//                again at the next joiner).
//   "recovered"  a recovery, shrink or growth is done; `detail` is its log line. The decision is
//                not used.
//
// An error or a decision the driver does not know ends the run naming the role and the answer.
// apps/examples/elastic_policy.cpp waits up to N seconds for a joiner, else shrinks.
#pragma once

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace troupe::actors {

struct elastic_event {
  std::string what;         // "lost", "joined" or "recovered"
  std::vector<int> ranks;   // the lost ranks, the joiner, or the ranks holding positions now
  std::int64_t step = 0;    // steps committed
  std::string plan;         // the plan now, e.g. "dp2 x pp2"
  std::int32_t spares = 0;  // idle ranks now
  double waited = 0;        // "lost": seconds waited for a joiner so far
  std::string detail;       // "recovered": the recovery's log line
  auto fields() { return std::tie(what, ranks, step, plan, spares, waited, detail); }
};

struct elastic_decision {
  std::string action = "default";  // see above
  double wait_s = 0;               // "wait": seconds
  auto fields() { return std::tie(action, wait_s); }
};

}  // namespace troupe::actors
