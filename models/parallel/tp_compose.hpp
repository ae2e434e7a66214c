// tp_compose: the two compositions the tensor-parallel layers share, written once for GPT-2 and
// Llama (tp_layers.hpp, tp_llama_layers.hpp).
//
//   region   y = exit(local(entry(x))): a layer whose local part (an attention with its shard's
//            heads, an MLP with its shard's hidden columns) runs on the region's full rows and
//            whose output is a partial sum; entry is copy_to_region (SP: gather_from_sequence),
//            exit reduce_from_region (SP: reduce_scatter_to_sequence) and the bias.
//   residual r = x + attn(norm_1(x)); y = r + ff(norm_2(r)): the pre-norm block, on the shard's
//            rows ([B, T, C], or with SP [B, T/tp, C]); residual_buffers holds its activations.
#pragma once

#include <cstdint>
#include <string_view>

#include "models/layers/slots.hpp"
#include "models/parallel/tp_mappings.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

// Entry, Exit: tp_entry, tp_exit (tp_layers.hpp).
template <class Entry, class Local, class Exit>
void region_forward(Entry& entry, Local& local, Exit& exit, const tensor& x, const tensor& y) {
  tensor xf = entry.forward(x);
  tensor p = exit.partial_buffer(y);
  local.forward(xf, p);
  exit.forward(p, y);
}

template <class Entry, class Local, class Exit>
void region_backward(Entry& entry, Local& local, Exit& exit, const tensor& dy, const tensor& dx) {
  tensor dyf = exit.backward(dy);
  tensor dxr = entry.grad_buffer(dx);
  local.backward(dyf, dxr);
  entry.backward(dxr, dx);
}

struct residual_buffers {
  tensor ln_1_out, attn_out, resid, ln_2_out, ff_out;  // activations, shaped like x
  tensor dnorm, dresid;                                // backward scratch

  // In the current scope, for the shard's rows of b (seq / tp with SP).
  void declare(slot_list& s, batch_dims b, std::int64_t dim, const tp_group& tp) {
    std::int64_t seq = tp.sequence_parallel ? b.seq / tp.size() : b.seq;
    shape bt{b.batch, seq, dim};
    s.activation("ln_1_out", bt, ln_1_out);
    s.activation("attn_out", bt, attn_out);
    s.activation("resid", bt, resid);
    s.activation("ln_2_out", bt, ln_2_out);
    s.activation("ff_out", bt, ff_out);
    s.scratch("dnorm", bt, dnorm);
    s.scratch("dresid", bt, dresid);
  }
};

template <class Norm, class Attn, class Ff>
void residual_forward(Norm& norm_1, Attn& attn, Norm& norm_2, Ff& ff, const residual_buffers& b,
                      const tensor& x, const tensor& y, std::string_view label) {
  const shape& sz = x.sizes();
  auto v = [&](const tensor& planned, const char* what) {
    return planned_view(planned, sz, label, what);
  };
  tensor l1 = v(b.ln_1_out, "ln_1_out"), ao = v(b.attn_out, "attn_out"), r = v(b.resid, "resid");
  tensor l2 = v(b.ln_2_out, "ln_2_out"), fo = v(b.ff_out, "ff_out");
  norm_1.forward(x, l1);
  attn.forward(l1, ao);
  ops::add(x, ao, r);
  norm_2.forward(r, l2);
  ff.forward(l2, fo);
  if (y.defined()) ops::add(r, fo, y);  // recompute needs the activations only
}

// dx may alias dy.
template <class Norm, class Attn, class Ff>
void residual_backward(Norm& norm_1, Attn& attn, Norm& norm_2, Ff& ff, const residual_buffers& b,
                       const tensor& dy, const tensor& dx, std::string_view label) {
  const shape& sz = dy.sizes();
  tensor dn = planned_view(b.dnorm, sz, label, "dnorm");
  tensor dr = planned_view(b.dresid, sz, label, "dresid");
  ff.backward(dy, dn);
  norm_2.backward(dn, dr);
  ops::add(dr, dy, dr);  // the residual path
  attn.backward(dr, dn);
  norm_1.backward(dn, dx);
  ops::add(dx, dr, dx);
}

}  // namespace troupe::models
