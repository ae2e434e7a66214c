// Stage partitioning: which contiguous layers each pipeline stage (or model chunk) holds.
//
// The model is a run of L transformer layers with per-layer costs (time or memory, any unit), plus
// the embedding on the first part and the head with the loss on the last. balanced_partition()
// splits it into `parts` contiguous, non-empty parts minimising the most expensive part (exact
// dynamic programme, O(parts * L^2)); even_partition() gives every part L / parts layers. With v
// chunks per stage there are p * v parts, and part k is virtual stage k: chunk k / p of stage k % p
// (pipeline.hpp), so the embedding lands on stage 0's chunk 0 and the head on stage p-1's last.
#pragma once

#include <vector>

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

// `parts` parts whose layer counts differ by at most one (the first L mod parts get one more),
// with their costs. Same errors.
partition even_partition(const layer_costs& c, int parts);

}  // namespace troupe::scheduler
