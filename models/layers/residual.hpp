// residual: the pre-norm transformer block's composition, written once for GPT-2 and Llama, whole
// (models/gpt.hpp, models/llama.hpp) and tensor parallel (models/parallel/tp_layers.hpp,
// tp_llama_layers.hpp):
//
//   r = x + attn(norm_1(x)); y = r + ff(norm_2(r))
//
// residual_buffers holds its activations and backward scratch, all shaped like x (a tensor shard
// with sequence parallelism plans [B, T/tp, C]). Norm, Attn and Ff are any layers with
// forward(x, y) and backward(dy, dx) on such tensors (Attn may also be an adaptor, e.g. attention
// over a kv cache for one decoding step).
#pragma once

#include <string_view>

#include "models/layers/slots.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

struct residual_buffers {
  tensor ln_1_out, attn_out, resid, ln_2_out, ff_out;  // activations, shaped like x
  tensor dnorm, dresid;                                // backward scratch

  // In the current scope, each of shape `bt` ([B, T, C] planned).
  void declare(slot_list& s, const shape& bt) {
    s.activation("ln_1_out", bt, ln_1_out);
    s.activation("attn_out", bt, attn_out);
    s.activation("resid", bt, resid);
    s.activation("ln_2_out", bt, ln_2_out);
    s.activation("ff_out", bt, ff_out);
    s.scratch("dnorm", bt, dnorm);
    s.scratch("dresid", bt, dresid);
  }
};

// y undefined: only the activations (what backward reads) are written, as a recompute needs.
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
  if (y.defined()) ops::add(r, fo, y);
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
