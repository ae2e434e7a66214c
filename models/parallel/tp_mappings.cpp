// Tensor-parallel mappings and weight slicing (see tp_mappings.hpp).
#include "models/parallel/tp_mappings.hpp"

#include "memory/error.hpp"
#include "models/layers/slots.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {

std::size_t count_of(const tensor& t) {
  return static_cast<std::size_t>(t.numel());
}

void check_contiguous(const tensor& t, const char* op, const char* what) {
  TROUPE_CHECK(t.defined() && t.is_contiguous(), op, ": ", what, " must be contiguous, got ",
               t.defined() ? t.describe() : std::string("undefined"));
}

// [B, T, rest...] viewed as [B, tp, T/tp, R] with dims 0 and 1 swapped: [tp, B, T/tp, R].
tensor blocks_view(const tensor& full, int tp) {
  std::int64_t b = full.size(0), t = full.size(1);
  std::int64_t r = full.numel() / (b * t);
  return full.reshape({b, tp, t / tp, r}).transpose(0, 1);
}

}  // namespace

std::int64_t divide_by_tp(std::int64_t n, int tp, std::string_view what) {
  TROUPE_CHECK(tp >= 1 && n % tp == 0, what, " (", n,
               ") must be divisible by the tensor-parallel size (", tp, ")");
  return n / tp;
}

void allreduce_sum(const tp_group& g, const tensor& x) {
  if (g.size() == 1 || x.numel() == 0) return;
  check_contiguous(x, "allreduce_sum", "x");
  g.comm->allreduce(x.data(), count_of(x), x.type()).wait();
}

void gather_sequence(const tp_group& g, const tensor& x_local, const tensor& out,
                     const tensor& scratch) {
  check_contiguous(x_local, "gather_sequence", "x_local");
  check_contiguous(out, "gather_sequence", "out");
  int tp = g.size();
  TROUPE_CHECK(x_local.dim() >= 2 && out.dim() == x_local.dim() && out.size(0) == x_local.size(0) &&
                   out.size(1) == x_local.size(1) * tp && out.numel() == x_local.numel() * tp,
               "gather_sequence: out must be x_local ", x_local.sizes().str(),
               " with the sequence (dim 1) ", tp, " times longer, got ", out.sizes().str());
  if (tp == 1) {
    ops::copy(x_local, out);
    return;
  }
  if (out.numel() == 0) return;
  if (out.size(0) == 1) {
    g.comm->all_gather(x_local.data(), out.data(), count_of(x_local), x_local.type()).wait();
    return;
  }
  TROUPE_CHECK(scratch.defined() && scratch.numel() >= out.numel() && scratch.type() == out.type(),
               "gather_sequence: scratch must hold ", out.numel(), " elements, got ",
               scratch.defined() ? scratch.describe() : std::string("undefined"));
  tensor buf = scratch.reshape({scratch.numel()}).narrow(0, 0, out.numel());
  g.comm->all_gather(x_local.data(), buf.data(), count_of(x_local), x_local.type()).wait();
  tensor dst = blocks_view(out, tp);
  ops::copy(buf.reshape(dst.sizes()), dst);
}

void reduce_scatter_sequence(const tp_group& g, const tensor& x, const tensor& out,
                             const tensor& scratch) {
  check_contiguous(x, "reduce_scatter_sequence", "x");
  check_contiguous(out, "reduce_scatter_sequence", "out");
  int tp = g.size();
  TROUPE_CHECK(out.dim() >= 2 && x.dim() == out.dim() && x.size(0) == out.size(0) &&
                   x.size(1) == out.size(1) * tp && x.numel() == out.numel() * tp,
               "reduce_scatter_sequence: x must be out ", out.sizes().str(),
               " with the sequence (dim 1) ", tp, " times longer, got ", x.sizes().str());
  if (tp == 1) {
    ops::copy(x, out);
    return;
  }
  if (x.numel() == 0) return;
  if (x.size(0) == 1) {
    g.comm->reduce_scatter(x.data(), out.data(), count_of(out), x.type()).wait();
    return;
  }
  TROUPE_CHECK(scratch.defined() && scratch.numel() >= x.numel() && scratch.type() == x.type(),
               "reduce_scatter_sequence: scratch must hold ", x.numel(), " elements, got ",
               scratch.defined() ? scratch.describe() : std::string("undefined"));
  tensor src = blocks_view(x, tp);
  tensor buf = scratch.reshape({scratch.numel()}).narrow(0, 0, x.numel()).reshape(src.sizes());
  ops::copy(src, buf);
  g.comm->reduce_scatter(buf.data(), out.data(), count_of(out), x.type()).wait();
}

void gather_last_dim(const tp_group& g, const tensor& x_local, const tensor& out,
                     const tensor& scratch) {
  check_contiguous(x_local, "gather_last_dim", "x_local");
  check_contiguous(out, "gather_last_dim", "out");
  int tp = g.size();
  TROUPE_CHECK(
      x_local.dim() >= 1 && out.sizes() == with_last(x_local.sizes(), x_local.size(-1) * tp),
      "gather_last_dim: out must be x_local ", x_local.sizes().str(),
      " with the last extent times ", tp, ", got ", out.sizes().str());
  if (tp == 1) {
    ops::copy(x_local, out);
    return;
  }
  if (out.numel() == 0) return;
  TROUPE_CHECK(scratch.defined() && scratch.numel() >= out.numel() && scratch.type() == out.type(),
               "gather_last_dim: scratch must hold ", out.numel(), " elements");
  std::int64_t c = x_local.size(-1), n = x_local.numel() / c;
  tensor buf = scratch.reshape({scratch.numel()}).narrow(0, 0, out.numel());
  g.comm->all_gather(x_local.data(), buf.data(), count_of(x_local), x_local.type()).wait();
  tensor dst = out.reshape({n, tp, c}).transpose(0, 1);
  ops::copy(buf.reshape({tp, n, c}), dst);
}

void copy_shard(const tensor& full, int dim, int rank, int tp, const tensor& dst) {
  std::int64_t n = divide_by_tp(full.size(dim), tp, "copy_shard: the sharded extent");
  ops::copy(full.narrow(dim, rank * n, n), dst);
}

void copy_qkv_shard(const tensor& full, std::int64_t hq, std::int64_t hkv, std::int64_t d, int rank,
                    int tp, const tensor& dst) {
  std::int64_t lq = divide_by_tp(hq, tp, "copy_qkv_shard: n_head");
  std::int64_t lkv = divide_by_tp(hkv, tp, "copy_qkv_shard: n_kv_head");
  TROUPE_CHECK(full.size(0) == (hq + 2 * hkv) * d && dst.size(0) == (lq + 2 * lkv) * d,
               "copy_qkv_shard: full must have ", (hq + 2 * hkv) * d, " rows and dst ",
               (lq + 2 * lkv) * d, ", got ", full.describe(), " and ", dst.describe());
  ops::copy(full.narrow(0, rank * lq * d, lq * d), dst.narrow(0, 0, lq * d));
  ops::copy(full.narrow(0, (hq + rank * lkv) * d, lkv * d), dst.narrow(0, lq * d, lkv * d));
  ops::copy(full.narrow(0, (hq + hkv + rank * lkv) * d, lkv * d),
            dst.narrow(0, (lq + lkv) * d, lkv * d));
}

}  // namespace troupe::models
