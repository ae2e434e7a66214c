// ring_context: models/layers/sequence_ring.hpp over a communicator, with
// models/layers/ring_attention.hpp as the core (context parallelism, parallel.cp_mode = "ring").
// One per model: every layer's attention calls it in turn; the ring op's workspace (two key/value
// blocks in flight and the backward accumulators) is planned for the first call's shapes and
// planned again only when a call's shapes differ (a smaller last microbatch).
#pragma once

#include <memory>

#include "collective/communicator.hpp"
#include "models/layers/ring_attention.hpp"
#include "models/layers/sequence_ring.hpp"

namespace troupe::models::parallel {

class ring_context final : public sequence_ring {
 public:
  ring_context(collective::communicator& cp, sequence_layout layout);

  int degree() const override { return cp_.size(); }
  std::vector<sequence_piece> pieces(std::int64_t local_seq) const override;
  void forward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
               const tensor& lse, bool causal) override;
  void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                const tensor& lse, const tensor& dout, const tensor& dq, const tensor& dk,
                const tensor& dv, bool causal) override;

 private:
  ring_attention& op_for(const tensor& q, const tensor& k, bool causal);

  collective::communicator& cp_;
  sequence_layout layout_;
  std::unique_ptr<ring_attention> op_;
};

}  // namespace troupe::models::parallel
