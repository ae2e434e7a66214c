// grad_producer: what the data-parallel engine (dp_trainer) needs of the model piece one rank
// trains, so that the same gradient reduction, ZeRO sharding, clipping and AdamW serve a whole
// model, a tensor-parallel shard, a pipeline stage, or a tensor-parallel shard of a stage.
//
// The producer owns the piece's planned memory (one flat parameter and one flat gradient buffer)
// and runs the forward and backward passes of a step's microbatches however its plan says: one
// after the other for a whole model, along a pipeline schedule for a stage. The engine owns what
// happens to the gradients afterwards.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <utility>

#include "collective/communicator.hpp"
#include "models/block_use.hpp"
#include "models/layers/slots.hpp"
#include "models/token_objective.hpp"

namespace troupe::models::parallel {

// Microbatch k of a step as this data-parallel rank reads it: token ids and next-token targets,
// i32 [rows, seq] on the host (valid until the next fetch), and its weight (rows / global batch:
// the factor on its mean-loss gradient). Post-training (models/post/plan_samples.hpp) may add
// packed rows (segments and positions i32 [rows, seq], trunk::set_packing; undefined: one
// sequence per row; every piece honours them: a whole model, a tensor shard, a pipeline stage) and
// a per-token objective (models/token_objective.hpp; empty: the mean cross-entropy), which the
// piece evaluates where its logits are.
struct microbatch_data {
  microbatch_data() = default;
  microbatch_data(tensor i, tensor t, double w)
      : ids(std::move(i)), targets(std::move(t)), weight(w) {}
  tensor ids, targets;
  double weight = 0;
  tensor segments, positions;
  token_objective objective;
};

// Post-training data (models/post/plan_samples.hpp): the microbatch of the samples [begin, end)
// of the run's sample stream (step s reads [s * g, (s + 1) * g), g = batch x grad_accum: the
// single-process trainer's rows of draws s * grad_accum ..), with the plan's weight (rows / g),
// which the source may replace (SFT weighs a microbatch by its share of the step's assistant
// tokens). The returned tensors stay valid until the next call.
struct sample_request {
  std::int64_t step = 0, begin = 0, end = 0;
  double weight = 0;
};
using sample_source = std::function<microbatch_data(const sample_request&)>;

class grad_producer {
 public:
  virtual ~grad_producer() = default;

  // The piece's parameters and gradients (flat: memory().params(), memory().grads()) and names.
  virtual layer_memory& memory() = 0;
  virtual const slot_list& slots() const = 0;

  // Forward and backward of this rank's `microbatches` microbatches of one step; fetch(k) gives
  // microbatch k (k ascending, each at most once). Accumulates sum_k weight_k * d loss_k / d params
  // into memory().grads() (the caller zeroed them) and returns sum_k weight_k * loss_k, the same
  // value on every rank of the piece's model-parallel group (pipeline stages and tensor shards of
  // one data-parallel replica).
  virtual double forward_backward(int microbatches,
                                  const std::function<microbatch_data(int k)>& fetch) = 0;

  // Makes forward_backward call f(i) as soon as the gradients of block i (parameters named
  // "<scope>.<i>.*", global layer index) are final for the step, i.e. after the last microbatch's
  // backward through it. False when the piece has no such point (the engine then reduces
  // everything after forward_backward returns). An empty f stops the calls. Once f(i) is called,
  // block i's gradients belong to the engine: under ZeRO 2 and 3 with dp_options::release_grads
  // (on by default) it reduces them in the background, then zeroes them and gives their pages back
  // (models/parallel/data_parallel.hpp), so the piece must not read or write them again in this
  // forward_backward.
  virtual bool set_block_grads_hook(std::function<void(std::int64_t block)> f) {
    (void)f;
    return false;
  }

  // Makes forward_backward call f(k, i) right after microbatch k's backward through block i, and
  // f(k, -1) once microbatch k's backward is complete (every gradient it adds is written), for
  // every microbatch k. Lets the engine reduce a block's gradients microbatch by microbatch and
  // give their memory back (ZeRO 2, 3); the gradients of a block must then be written by that
  // block's backward only (parameters outside the blocks, e.g. a tied embedding, may be written
  // anywhere: the engine reduces them after forward_backward). False when the piece has no such
  // points. An empty f stops the calls. As above, block i's gradients are the engine's from f(k, i)
  // until f(k, -1) returns (they read as zeros then, for the next microbatch to accumulate into):
  // the piece must not read or write them in between, nor read them after the last microbatch.
  virtual bool set_microbatch_grads_hook(std::function<void(int k, std::int64_t block)> f) {
    (void)f;
    return false;
  }

  // Makes forward_backward call f around every use of a block's parameters, in every microbatch
  // (models/block_use.hpp: before and after each block's forward, and its backward with any
  // recomputed forward inside), on the thread that called forward_backward. False when the piece
  // has no such points (ZeRO 3 then gathers every parameter before forward_backward). An empty f
  // stops the calls.
  virtual bool set_block_use_hook(block_use_hook f) {
    (void)f;
    return false;
  }

  // Post-training steps (data_parallel.hpp: step(sample_source)): every rank of the piece reads
  // each of its microbatches, not only the ranks that hold the model's ends, since a microbatch
  // may carry packed rows that every block's attention needs (a pipeline's middle stages fetch
  // them too). Off: a middle pipeline stage reads no data.
  virtual void set_every_stage_reads(bool on) { (void)on; }

  // Loss scaling (f16 under mixed_piece): true when the piece runs its backward on a scaled loss,
  // so a step's gradients may overflow; the engine then calls set_loss_scale before each
  // forward_backward and grads_finite after it, and skips the step's update when any rank of the
  // grid saw an overflow (data_parallel.hpp).
  virtual bool scales_loss() const { return false; }
  // The next forward_backward runs the backward of s x each microbatch's weighted loss and
  // delivers the gradients divided by s again (the returned loss is not scaled).
  virtual void set_loss_scale(double s) { (void)s; }
  // Whether every gradient the last forward_backward computed on this rank is finite.
  virtual bool grads_finite() { return true; }

  // Gradient norm across model parallelism: the global norm is the square root of the sum, over
  // the ranks of norm_group() (null: this rank alone), of the squares of the gradients of the
  // parameters this rank counts. A parameter replicated on several ranks of the group (a
  // LayerNorm on every tensor shard, a tied embedding on the first and last stage) is counted by
  // exactly one of them.
  virtual collective::communicator* norm_group() { return nullptr; }
  virtual bool counts_in_norm(const tensor_slot& parameter) const {
    (void)parameter;
    return true;
  }
};

}  // namespace troupe::models::parallel
