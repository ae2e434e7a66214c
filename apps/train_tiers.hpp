// The `troupe train` path with memory tiers (--device-memory ...; the [memory] table of
// models/train_config.hpp): one process trains a GPT-2 or a Llama through
// models::offload_trainer, its parameters, gradients and AdamW state in chunks paged between the
// device, host and NVMe tiers.
// Same progress log, checkpoints (trainer::save's layout) and sample as the plain path, plus a
// line of the tiers' state. Started by `troupe launch -n 1`, the trainer runs inside the
// tier-manager role actor (actors/tier_actor.hpp), so `troupe ps` / `troupe top` show its tiers
// while it trains. A tier failure (a full NVMe tier, an I/O error) stops the run with the store's
// path and the last checkpoint, which it leaves untouched.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include "models/causal_lm.hpp"
#include "models/train_config.hpp"
#include "models/trainer.hpp"

namespace troupe::apps {

struct tiered_hooks {
  std::string model_label;  // the model's name for the banner
  // Called once the first step is known (after a resume); returns the per-step reporter.
  std::function<std::function<void(const models::step_result&)>(std::int64_t first_step)> progress;
  // After each checkpoint save (models/train_loop.hpp's on_save).
  std::function<void(std::int64_t step, const std::string& folder,
                     std::optional<std::int64_t> held)>
      on_save;
  // Called at the end with the trained weights in a batch-1 model (e.g. to sample from it).
  std::function<void(models::causal_lm&)> done;
};

int run_tiered(const models::train_config& cfg, const models::hf::model_config& mcfg,
               const tiered_hooks& hooks);

}  // namespace troupe::apps
