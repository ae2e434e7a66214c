// pipeline_generation: kv-cache decoding through pipeline stages (gpt_stage, llama_stage; each
// maybe a tensor shard), with the interface of the models' begin_generation / step_logits.
//
// Every rank of the pipeline (and of each stage's tensor group) calls step_logits with the same
// ids. A step runs as the passes of tp_generation (the new positions whole on every tensor shard;
// with sequence parallelism passes of at most T/tp positions); each pass goes through the virtual
// stages in order: virtual stage k runs its chunk over its blocks' caches
// (pipeline_stage::step_chunk) and sends the activation [B, n, C] to the rank of virtual stage
// k + 1 over the pp communicator. The last virtual stage gathers the last position's logits over
// its tensor group and sends the full [B, V] to every other stage, so step_logits returns the
// same bytes on every rank and a sampler seeded alike picks the same token everywhere.
//
// The pp communicator carries send/recv only (as in pipeline_runner.hpp); every send is waited
// for in place: a step is a chain, one virtual stage after the other. Between training steps only.
// A rank whose step throws leaves its peers waiting in their receives (and tensor collectives)
// until the job aborts the communicators, as a failed training step's peers outside the pp group.
#pragma once

#include <cstdint>

#include "collective/communicator.hpp"
#include "models/parallel/pipeline_stage.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::parallel {

class pipeline_generator {
 public:
  // stage: this rank's stage; pp: its pipeline group, ranks = stages in order (pp.rank() ==
  // stage.stage()). dim: the model width (the activation's last extent). Both outlive this.
  pipeline_generator(pipeline_stage& stage, collective::communicator& pp, std::int64_t dim);

  // As gpt::begin_generation: `batch` sequences of up to `capacity` positions (0: max_seq).
  void begin_generation(std::int64_t batch, std::int64_t capacity = 0);
  // ids i32 [B, t] on the host, the same on every rank; the logits of the last new position,
  // [B, V] on every rank (valid until the next call).
  tensor step_logits(const tensor& ids);
  std::int64_t generated_length() const { return length_; }

 private:
  pipeline_stage& stage_;
  collective::communicator& pp_;
  std::int64_t dim_;
  std::int64_t length_ = 0;
  owned_tensor in_, out_;  // f32 [batch * rows * dim]: the activation received and sent
};

}  // namespace troupe::models::parallel
