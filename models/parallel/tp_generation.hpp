// tp_generation: a tensor shard's kv-cache decoding (tp_gpt, tp_llama), with the interface of
// gpt's and llama's begin_generation / step_logits (models/kv_cache.hpp), so that generate()
// (models/generation.hpp) drives a shard like the unsharded model.
//
//   cache     the shard's attention layers cache their own n_kv_head/tp key/value heads.
//   passes    every shard runs the step's new positions whole, also with sequence parallelism (the
//             region's full-sequence path, tp_compose.hpp): a step of t tokens need not divide
//             tp. Its rows must fit the shard's planned activations, T/tp per sequence with SP,
//             so a step longer than that (a prompt) runs as several cached passes of at most
//             `rows` positions, each attending over the cache the earlier ones filled: the same
//             numbers as one pass, up to rounding.
//   logits    the head gives the shard's vocabulary columns of the last position [B, V/tp]; they
//             are gathered into the full [B, V] on every shard, the same bytes everywhere, so a
//             sampler seeded alike picks the same token on every shard.
//
// All shards call begin and every step together (the passes hold the group's collectives).
// Buffers are allocated when generation begins; steps do not allocate.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string_view>

#include "models/kv_cache.hpp"
#include "models/parallel/tp_mappings.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct tp_generation_plan {
  std::int64_t n_layer = 0;
  std::int64_t batch = 1;      // sequences generated together
  std::int64_t capacity = 0;   // positions per sequence (0: max_seq)
  std::int64_t n_kv_head = 0;  // the shard's key/value heads (n_kv_head / tp)
  std::int64_t head_dim = 0;
  std::int64_t vocab = 0;      // the whole vocabulary
  std::int64_t rows = 0;       // positions one pass may run: the shard's planned rows
  std::int64_t max_batch = 0;  // the model's planned batch
  std::int64_t max_step = 0;   // new positions one step may bring: the model's planned seq
  std::int64_t max_seq = 0;    // the model's positions
};

class tp_generation {
 public:
  tp_generation(const tp_generation_plan& p, tp_group tp);
  tp_generation(const tp_generation&) = delete;
  tp_generation& operator=(const tp_generation&) = delete;

  const tp_generation_plan& plan() const { return plan_; }
  const kv_layer& layer(std::int64_t i) const { return cache_.layer(i); }
  std::int64_t length() const { return cache_.length(); }
  void clear() { cache_.clear(); }  // a new sequence, the same plan

  // Checks ids (i32 [B, t] on the host, B <= batch, t <= max_step) and the room left, then calls
  // pass(ids [B, n], start) for consecutive passes of n <= rows positions from start = length()
  // (ids copied into a contiguous buffer where a pass's are not), advancing the cache after each.
  // Returns the last pass's n. `who` names the model in errors.
  std::int64_t run(const tensor& ids, std::string_view who,
                   const std::function<void(const tensor& ids, std::int64_t start)>& pass);
  // Where the head writes the shard's columns of the last position, [B, V/tp].
  tensor local_logits(std::int64_t b) const;
  // local_logits(b) of every shard side by side: [B, V], the same on every shard (valid until the
  // next step).
  tensor gather(std::int64_t b);
  // Where gather(b) writes, for a rank that receives the logits instead (pipeline_generation.hpp).
  tensor full_logits(std::int64_t b) const { return full_.narrow(0, 0, b); }

 private:
  tp_generation_plan plan_;
  tp_group tp_;
  kv_cache cache_;
  owned_tensor ids_, local_, full_, scratch_;
};

// begin_generation of a shard: checks batch (1..max_batch) and capacity (0: max_seq; at most
// max_seq), then empties `gen` when it was planned alike, else plans it anew (the old one freed
// first).
void begin_tp_generation(std::unique_ptr<tp_generation>& gen, tp_generation_plan p,
                         const tp_group& tp, std::string_view who);

}  // namespace troupe::models
