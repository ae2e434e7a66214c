// attention_merge: folds the attention of queries over one more block of keys into a running
// result, by the online-softmax rule (ring attention, blockwise attention).
//
// For each query row i (b, t, h), with (out, lse) the attention over the keys seen so far and
// (part_out, part_lse) the attention over a disjoint block of keys (both as ops::attention writes
// them):
//
//   lse'   = log(exp(lse) + exp(part_lse))
//   out'   = out * exp(lse - lse') + part_out * exp(part_lse - lse')
//
// which is the attention over the union of the two key sets. An lse of -inf (no key seen yet)
// takes the other side whole. out and part_out [B, T, H, D] with a contiguous last dimension (views
// of a larger sequence are fine); lse and part_lse [B, H, T], any strides. f32 and f64 on the CPU;
// the weights are computed in f64 and each element of out is rounded once. The CUDA backend has no
// kernel for it yet and is refused naming the op.
#pragma once

#include "tensor/tensor.hpp"

namespace troupe::ops {

void attention_merge(const tensor& out, const tensor& lse, const tensor& part_out,
                     const tensor& part_lse);

}  // namespace troupe::ops
