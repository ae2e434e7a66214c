// moe_dispatch: an MoE layer's experts over an expert-parallel group (moe_dispatch.hpp,
// moe_ffn.hpp): the send side is expert-major (expert 0's rows, expert 1's, ...; peer p's experts
// are consecutive, so its block is one run), the receive side source-major (from rank 0: its rows
// for local expert 0, 1, ...; then rank 1's, ...). Each local expert runs once on the rows of every
// source, gathered into its own contiguous input.
#include <numeric>

#include "memory/error.hpp"
#include "models/layers/moe_ffn.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {

// rows [at, at + n) of a 2-d tensor (n may be 0: nothing is read or written through it).
tensor run(const tensor& t, std::int64_t at, std::int64_t n) {
  return t.narrow(0, at, n);
}

std::int64_t total(const std::vector<std::int64_t>& v) {
  return std::accumulate(v.begin(), v.end(), std::int64_t{0});
}

}  // namespace

std::vector<std::int64_t> moe_ffn::send_rows() const {
  const std::int32_t l = local_experts();
  std::vector<std::int64_t> out(static_cast<std::size_t>(cfg.ep), 0);
  for (std::int32_t e = 0; e < cfg.n_expert; ++e)
    out[e / l] += static_cast<std::int64_t>(routing.experts[e].size());
  return out;
}

std::vector<std::int64_t> moe_ffn::recv_rows() const {
  const std::int32_t l = local_experts();
  std::vector<std::int64_t> out(static_cast<std::size_t>(cfg.ep), 0);
  for (std::size_t i = 0; i < received.size(); ++i) out[i / l] += received[i];
  return out;
}

std::int64_t moe_ffn::recv_offset(int s, std::int32_t j) const {
  const std::int32_t l = local_experts();
  std::int64_t at = 0;
  for (int i = 0; i < s * l + j; ++i) at += received[i];
  return at;
}

void moe_ffn::move_expert_rows(std::int32_t j, const tensor& recv, const tensor& dense,
                               bool to_dense) const {
  const std::int32_t l = local_experts();
  std::int64_t pos = 0;
  for (int s = 0; s < cfg.ep; ++s) {
    const std::int64_t m = received[s * l + j];
    if (m > 0) {
      const tensor far = run(recv, recv_offset(s, j), m), near = run(dense, pos, m);
      to_dense ? ops::copy(far, near) : ops::copy(near, far);
    }
    pos += m;
  }
}

void moe_ffn::ep_forward(const tensor& xr, const tensor& yr) {
  TROUPE_CHECK(exchange != nullptr && exchange->size() == cfg.ep && exchange->rank() == cfg.ep_rank,
               label, ": expert parallelism ep ", cfg.ep, " rank ", cfg.ep_rank,
               " needs its group's exchange (set_expert_exchange), got ",
               exchange == nullptr ? std::string("none")
                                   : "rank " + std::to_string(exchange->rank()) + " of " +
                                         std::to_string(exchange->size()));
  const std::int64_t c = cfg.dim, out_rows = rows_ * cfg.top_k;
  const std::int32_t l = local_experts();
  // 1. Counts: how many rows go to each expert of every peer, before the rows.
  std::vector<std::int64_t> sending(static_cast<std::size_t>(cfg.n_expert));
  for (std::int32_t e = 0; e < cfg.n_expert; ++e)
    sending[e] = static_cast<std::int64_t>(routing.experts[e].size());
  exchange->counts(sending, received, l);
  // 2. The rows, expert by expert.
  const tensor send = planned_view(ep_send, {out_rows, c}, label, "ep_send");
  std::int64_t at = 0;
  for (std::int32_t e = 0; e < cfg.n_expert; ++e) {
    if (sending[e] > 0) dispatch(routing, e, xr, run(send, at, sending[e]));
    at += sending[e];
  }
  const std::vector<std::int64_t> to = send_rows(), from = recv_rows();
  const std::int64_t in_rows = total(from);
  TROUPE_CHECK(in_rows <= ep_recv.numel() / c, label, ": ", in_rows,
               " rows received, more than the planned ", ep_recv.numel() / c);
  const tensor recv =
      planned_view(ep_recv, {std::max<std::int64_t>(in_rows, 1), c}, label, "ep_recv");
  exchange->rows(send, to, recv, from);
  // 3. Each local expert on what every rank sent it; its outputs back into the receive layout.
  served.assign(static_cast<std::size_t>(l), 0);
  for (std::int32_t j = 0; j < l; ++j) {
    for (int s = 0; s < cfg.ep; ++s) served[j] += received[s * l + j];
    const std::int64_t n = served[j];
    if (n == 0) continue;
    const tensor in = planned_view(expert_in[j], {n, c}, label, "expert_in");
    const tensor out = planned_view(expert_out[j], {n, c}, label, "expert_out");
    move_expert_rows(j, recv, in, true);
    experts[j].forward(in, out);
    move_expert_rows(j, recv, out, false);
  }
  // 4. The outputs come back expert by expert, and are weighted into y in expert order.
  const tensor back = planned_view(ep_out, {out_rows, c}, label, "ep_out");
  exchange->rows(recv, from, back, to);
  at = 0;
  for (std::int32_t e = 0; e < cfg.n_expert; ++e) {
    if (sending[e] > 0) combine(routing, e, run(back, at, sending[e]), yr);
    at += sending[e];
  }
}

void moe_ffn::ep_backward(const tensor& dyr, const tensor& dxr, const tensor& tmp,
                          std::vector<double>& dweight) {
  const std::int64_t c = cfg.dim, out_rows = rows_ * cfg.top_k, k = cfg.top_k;
  const std::int32_t l = local_experts();
  const tensor back = planned_view(ep_out, {out_rows, c}, label, "ep_out");
  const tensor send = planned_view(ep_send, {out_rows, c}, label, "ep_send");
  // The weighted output gradients (and d weight) of this rank's choices, expert by expert.
  std::int64_t at = 0;
  for (std::int32_t e = 0; e < cfg.n_expert; ++e) {
    const auto& list = routing.experts[e];
    const auto count = static_cast<std::int64_t>(list.size());
    if (count > 0) {
      const std::vector<double> dw =
          combine_backward(routing, e, dyr, run(back, at, count), run(send, at, count), tmp);
      for (std::size_t i = 0; i < list.size(); ++i)
        dweight[list[i].row * k + list[i].choice] = dw[i];
    }
    at += count;
  }
  const std::vector<std::int64_t> to = send_rows(), from = recv_rows();
  const tensor recv =
      planned_view(ep_recv, {std::max<std::int64_t>(total(from), 1), c}, label, "ep_recv");
  exchange->rows(send, to, recv, from);
  // Each local expert's backward over every rank's rows; its input gradients into the receive
  // layout. A local expert no rank chose runs nothing: its gradient stays zero this microbatch.
  for (std::int32_t j = 0; j < l; ++j) {
    const std::int64_t n = served[j];
    if (n == 0) continue;
    const tensor dout = planned_view(dexpert_out, {n, c}, label, "dexpert_out");
    const tensor din = planned_view(dexpert_in, {n, c}, label, "dexpert_in");
    move_expert_rows(j, recv, dout, true);
    experts[j].backward(dout, din);
    move_expert_rows(j, recv, din, false);
  }
  // The input gradients come back and are added into dx in expert order.
  exchange->rows(recv, from, send, to);
  at = 0;
  for (std::int32_t e = 0; e < cfg.n_expert; ++e) {
    const auto count = static_cast<std::int64_t>(routing.experts[e].size());
    if (count > 0) dispatch_backward(routing, e, run(send, at, count), dxr);
    at += count;
  }
}

}  // namespace troupe::models
