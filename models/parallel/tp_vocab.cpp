// Vocabulary-parallel embedding and cross-entropy (see tp_vocab.hpp).
#include "models/parallel/tp_vocab.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {

std::int64_t id_at(const tensor& ids, std::int64_t i) {
  return ids.type() == dtype::i32 ? static_cast<const std::int32_t*>(ids.data())[i]
                                  : static_cast<const std::int64_t*>(ids.data())[i];
}

void check_ids(const tensor& ids, const std::string& label, const char* what) {
  TROUPE_CHECK(ids.defined() && (ids.type() == dtype::i32 || ids.type() == dtype::i64) &&
                   ids.is_cpu() && ids.is_contiguous(),
               label, ": ", what, " must be contiguous i32 or i64 on the host, got ",
               describe(ids));
}

}  // namespace

// ---- vocab_parallel_embedding -----------------------------------------------------------------

vocab_parallel_embedding::vocab_parallel_embedding(const embedding::config& c, tp_group g)
    : cfg(c), tp(g) {
  local_vocab = divide_by_tp(c.vocab, g.size(), "vocab_parallel_embedding: vocab");
  vocab_start = g.rank() * local_vocab;
}

void vocab_parallel_embedding::declare(slot_list& s, std::string_view name, batch_dims b) {
  TROUPE_CHECK(cfg.vocab > 0 && cfg.dim > 0, "vocab_parallel_embedding '", name,
               "': vocab and dim must be > 0");
  auto sc = s.enter(name);
  label = "vocab_parallel_embedding '" + s.prefix() + "'";
  if (tp.sequence_parallel) divide_by_tp(b.seq, tp.size(), label + ": sequence length");
  param_spec spec = param_spec::split_along(0);
  spec.embedding = true;
  s.param("weight", {local_vocab, cfg.dim}, weight, dweight, std::move(spec));
  s.scratch("tp_dy_masked", {b.rows(), cfg.dim}, dy_masked);
  if (tp.sequence_parallel) {
    s.scratch("tp_full", {b.batch, b.seq, cfg.dim}, full);
    s.scratch("tp_buf", {b.rows() * cfg.dim}, scratch);
  }
  local_ids_.assign(static_cast<std::size_t>(b.rows()), 0);  // planned once, before step 1
}

tensor vocab_parallel_embedding::local_ids_view(std::int64_t n) {
  TROUPE_CHECK(n <= static_cast<std::int64_t>(local_ids_.size()), label, ": ", n,
               " ids but the layer was planned for ", local_ids_.size());
  return tensor(local_ids_.data(), local_ids_.size() * sizeof(std::int32_t), dtype::i32, {n});
}

void vocab_parallel_embedding::zero_foreign(const tensor& rows) const {
  for (auto [first, len] : foreign_) ops::fill(rows.narrow(0, first, len), 0.0);
}

void vocab_parallel_embedding::forward(const tensor& ids_in, const tensor& y) {
  lookup(ids_in, y, tp.sequence_parallel);
}

void vocab_parallel_embedding::forward_full_sequence(const tensor& ids_in, const tensor& y) {
  lookup(ids_in, y, /*split=*/false);
}

void vocab_parallel_embedding::lookup(const tensor& ids_in, const tensor& y, bool split) {
  TROUPE_CHECK(weight.defined(), label, ": parameters are not bound");
  check_ids(ids_in, label, "ids");
  TROUPE_CHECK(ids_in.dim() == 2, label, ": ids must be [B, T], got ", describe(ids_in));
  shape want{ids_in.size(0), ids_in.size(1), cfg.dim};
  shape local = want;
  if (split) local[1] = divide_by_tp(want[1], tp.size(), label + ": sequence length");
  TROUPE_CHECK(y.defined() && y.sizes() == local && y.is_contiguous(), label, ": y must be ",
               local.str(), ", got ", describe(y));
  ids = ids_in;
  std::int64_t n = ids.numel();
  tensor lid = local_ids_view(n);
  auto* li = static_cast<std::int32_t*>(lid.data());
  foreign_.clear();
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t id = id_at(ids, i);
    TROUPE_CHECK(id >= 0 && id < cfg.vocab, label, ": token id ", id, " at position ", i,
                 " is outside the vocabulary [0, ", cfg.vocab, ")");
    bool mine = id >= vocab_start && id < vocab_start + local_vocab;
    li[i] = mine ? static_cast<std::int32_t>(id - vocab_start) : 0;
    if (mine) continue;
    if (!foreign_.empty() && foreign_.back().first + foreign_.back().second == i)
      ++foreign_.back().second;
    else
      foreign_.emplace_back(i, 1);
  }
  tensor out = split ? planned_view(full, want, label, "tp_full") : y;
  if (n == 0) return;
  tensor out2 = out.reshape({n, cfg.dim});
  ops::embedding(lid, weight, out2);
  zero_foreign(out2);
  if (split)
    reduce_scatter_sequence(tp, out, y, scratch);
  else
    allreduce_sum(tp, y);
}

void vocab_parallel_embedding::backward(const tensor& dy) {
  TROUPE_CHECK(ids.defined(), label, ": backward called before forward");
  shape want{ids.size(0), ids.size(1), cfg.dim};
  shape local = want;
  if (tp.sequence_parallel) local[1] /= tp.size();
  TROUPE_CHECK(dy.defined() && dy.sizes() == local, label, ": dy must be ", local.str(), ", got ",
               describe(dy));
  std::int64_t n = ids.numel();
  if (n == 0) return;
  tensor dyf = dy;
  if (tp.sequence_parallel) {
    dyf = planned_view(full, want, label, "tp_full");
    gather_sequence(tp, dy, dyf, scratch);
  }
  tensor dm = planned_view(dy_masked, {n, cfg.dim}, label, "tp_dy_masked");
  ops::copy(dyf.reshape({n, cfg.dim}), dm);
  zero_foreign(dm);
  ops::embedding_backward(local_ids_view(n), dm, dweight);
}

void vocab_parallel_embedding::load_from(const embedding& full_layer) {
  TROUPE_CHECK(full_layer.cfg.vocab == cfg.vocab && full_layer.cfg.dim == cfg.dim, label,
               ": load_from needs an embedding [", cfg.vocab, ", ", cfg.dim, "]");
  copy_shard(full_layer.weight, 0, tp.rank(), tp.size(), weight);
}

// ---- vocab_parallel_cross_entropy -------------------------------------------------------------

vocab_parallel_cross_entropy::vocab_parallel_cross_entropy(const config& c, tp_group g)
    : cfg(c), tp(g) {
  local_vocab = divide_by_tp(c.vocab, g.size(), "vocab_parallel_cross_entropy: vocab");
  vocab_start = g.rank() * local_vocab;
}

void vocab_parallel_cross_entropy::declare(slot_list& s, std::string_view name, batch_dims b) {
  auto sc = s.enter(name);
  label = "vocab_parallel_cross_entropy '" + s.prefix() + "'";
  // Twice the rows: room for f32 statistics in the bytes of a bf16 / f16 memory (stats_of).
  s.activation("row_max", {2 * b.rows()}, row_max);
  s.activation("sum_exp", {2 * b.rows()}, sum_exp);
  s.activation("losses", {2 * b.rows()}, losses);
  s.scratch("tp_buf", {4 * b.rows()}, scratch);
}

namespace {

// The statistics' element type for logits of element type T: the logits' own for f32 and f64, f32
// for bf16 (its 8-bit mantissa would put a row's log-sum-exp off by up to 2^-5).
template <class T>
using stat_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// f16 logits' bits (std::uint16_t: bf16's); statistics in f32 as for bf16.
enum class f16_bits : std::uint16_t {};

template <class T>
stat_t<T> load(T v) {
  if constexpr (std::is_same_v<T, std::uint16_t>)
    return bf16_bits_to_f32(v);
  else if constexpr (std::is_same_v<T, f16_bits>)
    return f16_bits_to_f32(static_cast<std::uint16_t>(v));
  else
    return v;
}

template <class T>
T store(double v) {
  if constexpr (std::is_same_v<T, std::uint16_t>)
    return f32_to_bf16_bits(static_cast<float>(v));
  else if constexpr (std::is_same_v<T, f16_bits>)
    return static_cast<f16_bits>(f32_to_f16_bits(static_cast<float>(v)));
  else
    return static_cast<T>(v);
}

// The first n statistics of a planned activation (declared with twice the rows) as S.
template <class S>
S* stats_of(const tensor& t, std::int64_t n) {
  TROUPE_CHECK(static_cast<std::size_t>(n) * sizeof(S) <= t.nbytes(),
               "vocab_parallel_cross_entropy: ", n, " statistics do not fit ", t.describe());
  return static_cast<S*>(t.data());
}

template <class T>
double ce_forward(vocab_parallel_cross_entropy& l, std::int64_t n) {
  using S = stat_t<T>;
  std::int64_t v = l.local_vocab;
  const T* x = static_cast<const T*>(l.logits.data());
  S* mx = stats_of<S>(l.row_max, n);
  S* se = stats_of<S>(l.sum_exp, n);
  S* lo = stats_of<S>(l.losses, n);
  S* buf = stats_of<S>(l.scratch, 2 * n);
  for (std::int64_t i = 0; i < n; ++i) {
    S m = load(x[i * v]);
    for (std::int64_t j = 1; j < v; ++j) m = std::max(m, load(x[i * v + j]));
    mx[i] = m;
  }
  if (l.tp.size() > 1 && n > 0)
    l.tp.comm
        ->allreduce(mx, static_cast<std::size_t>(n), dtype_of<S>,
                    {.op = collective::reduce_op::max})
        .wait();
  for (std::int64_t i = 0; i < n; ++i) {
    double s = 0;
    for (std::int64_t j = 0; j < v; ++j)
      s += std::exp(static_cast<double>(load(x[i * v + j])) - mx[i]);
    std::int64_t t = id_at(l.targets, i);
    bool mine = t >= l.vocab_start && t < l.vocab_start + v;
    buf[i] = static_cast<S>(s);
    buf[n + i] = mine ? load(x[i * v + (t - l.vocab_start)]) : S(0);
  }
  if (l.tp.size() > 1 && n > 0)
    l.tp.comm->allreduce(buf, static_cast<std::size_t>(2 * n), dtype_of<S>).wait();
  double total = 0;
  l.count = 0;
  for (std::int64_t i = 0; i < n; ++i) {
    se[i] = buf[i];
    std::int64_t t = id_at(l.targets, i);
    if (t == l.cfg.ignore_index) {
      lo[i] = 0;
      continue;
    }
    lo[i] = static_cast<S>(std::log(static_cast<double>(buf[i])) + mx[i] - buf[n + i]);
    total += lo[i];
    ++l.count;
  }
  return l.count == 0 ? 0.0 : total / static_cast<double>(l.count);
}

template <class T>
void ce_backward(vocab_parallel_cross_entropy& l, const tensor& dlogits, std::int64_t n,
                 double scale, const double* row_scale) {
  using S = stat_t<T>;
  std::int64_t v = l.local_vocab;
  const T* x = static_cast<const T*>(l.logits.data());
  T* dx = static_cast<T*>(dlogits.data());
  const S* mx = stats_of<S>(l.row_max, n);
  const S* se = stats_of<S>(l.sum_exp, n);
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t t = id_at(l.targets, i);
    if (t == l.cfg.ignore_index) {
      std::fill(dx + i * v, dx + (i + 1) * v, store<T>(0.0));
      continue;
    }
    double inv = 1.0 / static_cast<double>(se[i]);
    const double s = row_scale != nullptr ? row_scale[i] : scale;
    for (std::int64_t j = 0; j < v; ++j) {
      double p = std::exp(static_cast<double>(load(x[i * v + j])) - mx[i]) * inv;
      if (j + l.vocab_start == t) p -= 1.0;
      dx[i * v + j] = store<T>(p * s);
    }
  }
}

}  // namespace

double vocab_parallel_cross_entropy::forward(const tensor& logits_in, const tensor& targets_in) {
  TROUPE_CHECK(logits_in.defined() && logits_in.dim() >= 1 && logits_in.size(-1) == local_vocab &&
                   logits_in.is_cpu() && logits_in.is_contiguous() &&
                   (logits_in.type() == dtype::f32 || logits_in.type() == dtype::f64 ||
                    logits_in.type() == dtype::bf16 || logits_in.type() == dtype::f16),
               label, ": logits must be contiguous f32, f64, bf16 or f16 [..., ", local_vocab,
               "] (the shard's vocabulary columns) on the host, got ", describe(logits_in));
  shape rows = logits_in.sizes();
  rows.erase(rows.rank() - 1);
  check_ids(targets_in, label, "targets");
  TROUPE_CHECK(targets_in.sizes() == rows, label, ": targets must be ", rows.str(), ", got ",
               describe(targets_in));
  TROUPE_CHECK(row_max.defined() && row_max.type() == logits_in.type(), label,
               ": the layer's memory must have the logits' dtype");
  std::int64_t n = leading_rows(logits_in.sizes());
  planned_view(losses, {2 * n}, label, "losses");  // checks the planned size
  for (std::int64_t i = 0; i < n; ++i) {
    std::int64_t t = id_at(targets_in, i);
    TROUPE_CHECK(t == cfg.ignore_index || (t >= 0 && t < cfg.vocab), label, ": target ", t,
                 " at position ", i, " is outside the vocabulary [0, ", cfg.vocab, ")");
  }
  logits = logits_in;
  targets = targets_in;
  if (tp.size() == 1) {  // one shard: the fused kernel (vectorized exp, one pass per row)
    tensor l = losses.narrow(0, 0, n);
    count = ops::cross_entropy(logits, targets, l, tensor{}, 0.0, cfg.ignore_index);
    return count == 0 ? 0.0 : ops::sum(l) / static_cast<double>(count);
  }
  switch (logits.type()) {
    case dtype::f32:
      return ce_forward<float>(*this, n);
    case dtype::f64:
      return ce_forward<double>(*this, n);
    case dtype::f16:
      return ce_forward<f16_bits>(*this, n);
    default:
      return ce_forward<std::uint16_t>(*this, n);  // bf16
  }
}

void vocab_parallel_cross_entropy::backward(const tensor& dlogits, double dloss) {
  TROUPE_CHECK(logits.defined(), label, ": backward called before forward");
  TROUPE_CHECK(dlogits.defined() && dlogits.sizes() == logits.sizes() &&
                   dlogits.type() == logits.type() && dlogits.is_contiguous() && dlogits.is_cpu(),
               label, ": dlogits must be like the logits ", logits.describe(), ", got ",
               describe(dlogits));
  std::int64_t n = leading_rows(logits.sizes());
  double scale = count == 0 ? 0.0 : dloss / static_cast<double>(count);
  std::vector<double> row_scale;
  if (!row_weights.empty()) {
    TROUPE_CHECK(static_cast<std::int64_t>(row_weights.size()) == n, label, ": ",
                 row_weights.size(), " row weights for ", n, " positions");
    row_scale.resize(row_weights.size());
    for (std::size_t i = 0; i < row_scale.size(); ++i) row_scale[i] = dloss * row_weights[i];
  }
  if (tp.size() == 1) {  // the fused kernel again (it may write dlogits over the logits)
    if (row_scale.empty()) {
      ops::cross_entropy(logits, targets, losses.narrow(0, 0, n), dlogits, scale, cfg.ignore_index);
      return;
    }
    // Row by row, each with its own scale (as token_logprobs_backward, models/post/), into a
    // scratch loss that leaves the saved statistics alone (two elements hold one f32 statistic
    // for bf16 logits).
    owned_tensor one = empty({2}, logits.type());
    const tensor flat = targets.reshape({n});
    for (std::int64_t i = 0; i < n; ++i)
      ops::cross_entropy(logits.narrow(0, i, 1), flat.narrow(0, i, 1), one.view().narrow(0, 0, 1),
                         dlogits.narrow(0, i, 1), row_scale[static_cast<std::size_t>(i)],
                         cfg.ignore_index);
    return;
  }
  const double* rs = row_scale.empty() ? nullptr : row_scale.data();
  switch (logits.type()) {
    case dtype::f32:
      ce_backward<float>(*this, dlogits, n, scale, rs);
      break;
    case dtype::f64:
      ce_backward<double>(*this, dlogits, n, scale, rs);
      break;
    case dtype::f16:
      ce_backward<f16_bits>(*this, dlogits, n, scale, rs);
      break;
    default:
      ce_backward<std::uint16_t>(*this, dlogits, n, scale, rs);  // bf16
  }
}

std::vector<double> vocab_parallel_cross_entropy::token_logprobs() const {
  TROUPE_CHECK(logits.defined(), label, ": token_logprobs called before forward");
  const std::int64_t n = leading_rows(logits.sizes());
  std::vector<double> out(static_cast<std::size_t>(n));
  // The statistics' type: the logits' for f64, f32 otherwise (f32 logits, and a sharded bf16
  // head's f32 statistics in the first n x 4 bytes).
  if (tp.size() == 1 && logits.type() != dtype::f32 && logits.type() != dtype::f64) {
    // One shard's fused kernel (forward) wrote the per-row losses in the logits' 16-bit type, as
    // the whole model's token log-probabilities are (models/post/policy_logprobs.hpp).
    owned_tensor wide = empty({n}, dtype::f64);
    ops::copy(losses.narrow(0, 0, n), wide);
    const double* lo = wide.data_as<double>();
    for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = -lo[i];
  } else if (logits.type() == dtype::f64) {
    const auto* lo = stats_of<double>(losses, n);
    for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = -lo[i];
  } else {
    const auto* lo = stats_of<float>(losses, n);
    for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = -lo[i];
  }
  return out;
}

}  // namespace troupe::models
