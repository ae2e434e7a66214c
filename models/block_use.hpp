// block_use: the points at which a model's forward and backward use the parameters of one block
// (the parameters named "<scope>.<i>.*"), reported to an optional hook so that a caller can bring
// them in just before and give them back just after (ZeRO 3: models/parallel/data_parallel.hpp).
//
// Contract for a model with an on_block_use hook: forward calls (i, before_forward) before block i
// reads a parameter and (i, after_forward) after its last read; backward the same with
// before_backward / after_backward, and a forward recomputed inside backward (activation
// checkpointing) runs between before_backward and after_backward. Outside those pairs the model
// reads only parameters outside the blocks (embeddings, final norm, head). Generation
// (step_logits) does not call the hook. An unset hook costs one test per call.
#pragma once

#include <cstdint>
#include <functional>

namespace troupe::models {

enum class block_use : std::uint8_t {
  before_forward,
  after_forward,
  before_backward,
  after_backward
};

using block_use_hook = std::function<void(std::int64_t block, block_use use)>;

inline void notify(const block_use_hook& hook, std::int64_t block, block_use use) {
  if (hook) hook(block, use);
}

}  // namespace troupe::models
