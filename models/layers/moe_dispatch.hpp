// moe_dispatch: what an MoE layer (moe_ffn.hpp) needs of an expert-parallel group to place its
// experts on several ranks: two all-to-alls, one of fixed-size counts and one of variable-size row
// blocks. The layer stays free of any communicator; models/parallel/expert_parallel.hpp implements
// it over a collective::communicator (all_to_all, all_to_allv).
//
// Expert parallelism of degree P = size() over n_expert experts: rank p holds experts
// [p * n_expert / P, (p + 1) * n_expert / P) of every MoE layer (n_expert divisible by P). Each
// rank routes its own tokens among all n_expert experts, then
//   1. counts:  every rank tells every peer how many rows it sends to each of the peer's experts
//               (n_expert / P counts per peer; the peer learns what it receives before the rows);
//   2. rows:    the rows go out expert by expert (all_to_allv), the local experts run on what
//               they received from every rank, and their outputs go back the same way reversed;
// and combines the returned rows with its routing weights exactly as one process does. Backward
// moves the weighted output gradients out and the experts' input gradients back the same way.
// Every rank of the group takes part in both exchanges of every MoE layer's forward and backward,
// whatever its tokens chose (zero rows to a peer is a block of zero rows), so a step that routes
// no token to some expert neither hangs nor leaves a rank out.
#pragma once

#include <cstdint>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::models {

class moe_exchange {
 public:
  virtual ~moe_exchange() = default;
  virtual int size() const = 0;  // ranks of the expert-parallel group
  virtual int rank() const = 0;  // this rank's place in it
  // send and recv: size() blocks of per_peer counts each; block p of send goes to rank p, block s
  // of recv came from rank s.
  virtual void counts(const std::vector<std::int64_t>& send, std::vector<std::int64_t>& recv,
                      std::int64_t per_peer) = 0;
  // in: rows [>= sum send_rows, C], send_rows[p] consecutive rows to rank p; out: rows
  // [>= sum recv_rows, C], recv_rows[s] consecutive rows from rank s. in and out are contiguous,
  // of one dtype, and must not overlap.
  virtual void rows(const tensor& in, const std::vector<std::int64_t>& send_rows, const tensor& out,
                    const std::vector<std::int64_t>& recv_rows) = 0;
};

}  // namespace troupe::models
