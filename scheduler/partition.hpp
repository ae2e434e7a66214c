// Stage partitioning: which contiguous layers each pipeline stage (or model chunk) holds.
//
// The model is a run of L transformer layers with per-layer costs (time or memory, any unit), plus
// the embedding on the first part and the head with the loss on the last. balanced_partition()
// splits it into `parts` contiguous, non-empty parts minimising the most expensive part (exact
// dynamic programme, O(parts * L^2)); even_partition() gives every part L / parts layers. With v
// chunks per stage there are p * v parts, and part k is virtual stage k: chunk k / p of stage k % p
// (pipeline.hpp), so the embedding lands on stage 0's chunk 0 and the head on stage p-1's last.
//
// transformer_costs() estimates the costs from a model's shape: FLOPs per token of one forward and
// backward (backward = 2 x forward), the matrix multiplications and the attention scores of each
// decoder block (2 x params + 4 T C per token forward, the causal mask not discounted), the head
// (2 C V for the logits, about 5 V for the softmax and the loss) and the embedding (a lookup, C).
// A GPT-2 small head at T = 1024 costs about 4.5 blocks, so an even split overloads the last
// stage; gpt2-demo's (C 128, V 256) costs 0.15 of a block and the split stays even.
#pragma once

#include <vector>

#include "scheduler/plan.hpp"

namespace troupe::scheduler {

struct layer_costs {
  std::vector<double> layers;  // one entry per transformer layer, >= 0
  double embedding = 0;        // added to the first part
  double head = 0;             // head and loss, added to the last part
};

struct partition {
  std::vector<int> first;    // parts + 1 entries: part k holds layers [first[k], first[k + 1])
  std::vector<double> cost;  // per part, embedding and head included
  int parts() const { return static_cast<int>(cost.size()); }
  int layers(int part) const { return first[part + 1] - first[part]; }
  double max_cost() const;
};

// The part (virtual stage) that chunk `chunk` of `stage` holds, with `stages` pipeline stages.
inline int part_index(int stage, int chunk, int stages) {
  return chunk * stages + stage;
}

// Splits the layers into `parts` contiguous non-empty parts with the smallest possible maximum part
// cost; among equally good splits, the one whose earlier parts are the largest. Throws
// std::invalid_argument when parts is not in [1, L] or a cost is negative.
partition balanced_partition(const layer_costs& c, int parts);

// The estimate above for m (layers, heads, kv_heads, hidden, vocab and seq must be > 0; ffn 0 is
// 4 x hidden), per token, for one tensor shard of tp (every term divides by tp). Throws
// std::invalid_argument naming the missing field.
layer_costs transformer_costs(const model_shape& m, int tp = 1);

// The partition `kind` of m's layers into `parts` (even_partition or balanced_partition of
// transformer_costs(m, tp)).
partition partition_layers(partition_kind kind, const model_shape& m, int parts, int tp = 1);

// `parts` parts whose layer counts differ by at most one (the first L mod parts get one more),
// with their costs. Same errors.
partition even_partition(const layer_costs& c, int parts);

}  // namespace troupe::scheduler
