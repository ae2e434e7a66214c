// ring_context (ring_context.hpp): the ring attention op behind the sequence_ring seam.
#include "models/parallel/ring_context.hpp"

#include "memory/error.hpp"
#include "models/layers/slots.hpp"

namespace troupe::models::parallel {

ring_context::ring_context(collective::communicator& cp, sequence_layout layout)
    : cp_(cp), layout_(layout) {}

std::vector<sequence_piece> ring_context::pieces(std::int64_t local_seq) const {
  return sequence_pieces(local_seq * cp_.size(), cp_.size(), cp_.rank(), layout_);
}

ring_attention& ring_context::op_for(const tensor& q, const tensor& k, bool causal) {
  TROUPE_CHECK(q.defined() && k.defined() && q.dim() == 4 && k.dim() == 4,
               "ring_context: q and k must be [B, Tl, H, D], got ", describe(q), " and ",
               describe(k));
  ring_attention_config c;
  c.batch = q.size(0);
  c.local_seq = q.size(1);
  c.n_head = q.size(2);
  c.n_kv_head = k.size(2);
  c.head_dim = q.size(3);
  c.type = q.type();
  c.layout = layout_;
  c.causal = causal;
  if (op_) {
    const auto& o = op_->config();
    if (o.batch == c.batch && o.local_seq == c.local_seq && o.n_head == c.n_head &&
        o.n_kv_head == c.n_kv_head && o.head_dim == c.head_dim && o.type == c.type &&
        o.causal == c.causal)
      return *op_;
    op_.reset();  // free the old workspace first
  }
  op_ = std::make_unique<ring_attention>(cp_, c);
  return *op_;
}

void ring_context::forward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                           const tensor& lse, bool causal) {
  op_for(q, k, causal).forward(q, k, v, out, lse);
}

void ring_context::backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                            const tensor& lse, const tensor& dout, const tensor& dq,
                            const tensor& dk, const tensor& dv, bool causal) {
  op_for(q, k, causal).backward(q, k, v, out, lse, dout, dq, dk, dv);
}

}  // namespace troupe::models::parallel
