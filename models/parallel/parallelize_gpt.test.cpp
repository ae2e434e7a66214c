// parallelize_gpt: a GPT-2 split over 2 and 4 tensor-parallel shards (threads of a local group)
// against the unsharded model: one step's loss and every gradient shard, then 10 training steps
// through the single-process trainer on both.
#include <catch2/catch.hpp>

#include <cstdint>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/testing.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

gpt_config tiny() {
  gpt_config c;
  c.vocab = 32;
  c.max_seq = 8;
  c.dim = 32;
  c.n_layer = 2;
  c.n_head = 4;
  return c;
}

}  // namespace

// One forward and backward: the loss and each gradient shard are as accurate as the unsharded
// model's (its slice), against the unsharded model in f64 (check_shards: sums reassociated across
// shards through two blocks, LayerNorms and the tied head, rounded like the single process's).
TEST_CASE("A tensor parallel GPT-2 matches the unsharded loss and gradients", "[parallel]") {
  batch_dims dims{2, 8};
  gpt full(tiny(), dims);
  full.init_weights(7);
  auto exact = f64_twin(full, dims);
  const token_batch b = random_tokens(dims, tiny().vocab, 8);
  const whole_step<gpt> w{full, one_step(full, b), *exact, one_step(*exact, b)};
  for (int tp : {2, 4})
    for (bool sp : {false, true}) {
      INFO("tp " << tp << " sp " << sp);
      check_shards(shard_steps(tp, w, b,
                               [&](collective::communicator& comm) {
                                 return parallelize_gpt(full, dims, comm, sp);
                               }),
                   w);
    }
}

// The trainer runs unchanged on each shard (causal_lm_of<tp_gpt>); clipping is off because the
// trainer's global norm would be per shard (a tp-aware norm is future work). Losses must track
// the single-process run over 10 AdamW steps, as accurately as it tracks the same run in f64.
TEST_CASE("Training a tiny GPT-2 in tp2 for 10 steps matches the single process trainer",
          "[parallel]") {
  testing::check_tp2_training<gpt, tp_gpt>(tiny(), 10, synthetic_rows);
}

// Activation recompute on a shard: the blocks share one set of activation bytes and run forward
// again before their backward (the tensor-parallel collectives again too); see
// check_tp2_recompute.
TEST_CASE("A tensor parallel GPT-2 with activation recompute gives the same gradients",
          "[parallel]") {
  gpt_config cfg = tiny();
  cfg.n_layer = 3;
  testing::check_tp2_recompute<gpt, tp_gpt>(cfg, {2, 8});
}
