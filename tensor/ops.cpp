// Validation and device dispatch for tensor/ops.hpp.
#include "tensor/ops.hpp"

#include <initializer_list>

#include "memory/error.hpp"
#include "tensor/backend.hpp"

namespace troupe::ops {
namespace {

struct arg {
  const char* name;
  const tensor& t;
};

// All defined arguments live on one device; returns it.
device common_device(const char* op, std::initializer_list<arg> args) {
  const arg* first = nullptr;
  for (const auto& a : args) {
    if (!a.t.defined()) continue;
    if (first == nullptr) {
      first = &a;
    } else {
      TROUPE_CHECK(a.t.dev() == first->t.dev(), op, ": ", a.name, " is on ", to_string(a.t.dev()),
                   " but ", first->name, " is on ", to_string(first->t.dev()));
    }
  }
  TROUPE_CHECK(first != nullptr, op, ": no tensor arguments given");
  return first->t.dev();
}

void need_defined(const char* op, const arg& a) {
  TROUPE_CHECK(a.t.defined(), op, ": ", a.name, " is undefined");
}
void need_contiguous(const char* op, const arg& a) {
  need_defined(op, a);
  TROUPE_CHECK(a.t.is_contiguous(), op, ": ", a.name, " must be contiguous, got ", a.t.describe());
}
void need_float(const char* op, const arg& a) {
  TROUPE_CHECK(is_floating(a.t.type()), op, ": ", a.name, " must be a floating dtype, got ",
               a.t.describe());
}
void need_same_type(const char* op, const arg& a, const arg& b) {
  TROUPE_CHECK(a.t.type() == b.t.type(), op, ": ", b.name, " has dtype ", dtype_name(b.t.type()),
               " but ", a.name, " has ", dtype_name(a.t.type()));
}
void need_same_shape(const char* op, const arg& a, const arg& b) {
  TROUPE_CHECK(a.t.sizes() == b.t.sizes(), op, ": ", b.name, " has shape ", b.t.sizes().str(),
               " but ", a.name, " has ", a.t.sizes().str());
}
void need_rank(const char* op, const arg& a, int r) {
  TROUPE_CHECK(a.t.dim() == r, op, ": ", a.name, " must have ", r, " dimensions, got ",
               a.t.describe());
}
// x viewed as rows [N, C]; returns C.
std::int64_t cols(const char* op, const arg& x) {
  TROUPE_CHECK(x.t.dim() >= 1, op, ": ", x.name, " must have at least one dimension");
  return x.t.size(-1);
}
void need_vector(const char* op, const arg& v, std::int64_t n, const arg& like) {
  need_contiguous(op, v);
  TROUPE_CHECK(v.t.dim() == 1 && v.t.size(0) == n, op, ": ", v.name, " must have shape [", n,
               "], got ", v.t.describe());
  need_same_type(op, like, v);
}
// Saved statistics (norm mean/rstd, attention lse, per-row losses) are contiguous and take the
// dtype of `like`, or f32 when `like` is bf16 or f16.
void need_stat_type(const char* op, const arg& v, const arg& like) {
  need_contiguous(op, v);
  const dtype x = like.t.type(), t = v.t.type();
  TROUPE_CHECK(t == x || (t == dtype::f32 && (x == dtype::bf16 || x == dtype::f16)), op, ": ",
               v.name, " has dtype ", dtype_name(t), " but ", like.name, " has ", dtype_name(x),
               " (statistics take the dtype of ", like.name, ", or f32 for bf16 and f16)");
}
void need_stat_vector(const char* op, const arg& v, std::int64_t n, const arg& like) {
  need_contiguous(op, v);
  TROUPE_CHECK(v.t.dim() == 1 && v.t.size(0) == n, op, ": ", v.name, " must have shape [", n,
               "], got ", v.t.describe());
  need_stat_type(op, v, like);
}
std::int64_t rows(const tensor& x) {
  return x.dim() == 0 ? 1 : x.numel() / std::max<std::int64_t>(x.size(-1), 1);
}

// Elementwise family: every argument contiguous, floating, same dtype and shape as the first.
void elementwise(const char* op, std::initializer_list<arg> args) {
  const arg& first = *args.begin();
  for (const auto& a : args) {
    need_contiguous(op, a);
    need_float(op, a);
    need_same_type(op, first, a);
    need_same_shape(op, first, a);
  }
}

}  // namespace

#if defined(TROUPE_HAVE_CUDA)
#define TROUPE_DISPATCH(dev, call)        \
  do {                                    \
    if ((dev).is_cpu()) return cpu::call; \
    return cuda::call;                    \
  } while (0)
#else
#define TROUPE_DISPATCH(dev, call)                                                   \
  do {                                                                               \
    if ((dev).is_cpu()) return cpu::call;                                            \
    TROUPE_FAIL("tensor on ", to_string(dev), " but troupe was built without CUDA"); \
  } while (0)
#endif

void fill(const tensor& x, double value) {
  need_contiguous("fill", {"x", x});
  TROUPE_DISPATCH(x.dev(), fill(x, value));
}

void copy(const tensor& src, const tensor& dst) {
  auto d = common_device("copy", {{"src", src}, {"dst", dst}});
  need_defined("copy", {"src", src});
  need_defined("copy", {"dst", dst});
  TROUPE_CHECK(src.sizes() == dst.sizes(), "copy: dst has shape ", dst.sizes().str(),
               " but src has ", src.sizes().str());
  TROUPE_CHECK(src.type() == dst.type() || (is_floating(src.type()) && is_floating(dst.type())),
               "copy: cannot convert ", dtype_name(src.type()), " to ", dtype_name(dst.type()));
  TROUPE_DISPATCH(d, copy(src, dst));
}

void add(const tensor& a, const tensor& b, const tensor& out) {
  elementwise("add", {{"a", a}, {"b", b}, {"out", out}});
  auto d = common_device("add", {{"a", a}, {"b", b}, {"out", out}});
  TROUPE_DISPATCH(d, add(a, b, out));
}
void mul(const tensor& a, const tensor& b, const tensor& out) {
  elementwise("mul", {{"a", a}, {"b", b}, {"out", out}});
  auto d = common_device("mul", {{"a", a}, {"b", b}, {"out", out}});
  TROUPE_DISPATCH(d, mul(a, b, out));
}
void axpy(double alpha, const tensor& x, const tensor& y) {
  elementwise("axpy", {{"x", x}, {"y", y}});
  auto d = common_device("axpy", {{"x", x}, {"y", y}});
  TROUPE_DISPATCH(d, axpy(alpha, x, y));
}
void scale(const tensor& x, double alpha) {
  elementwise("scale", {{"x", x}});
  TROUPE_DISPATCH(x.dev(), scale(x, alpha));
}
void add_bias(const tensor& x, const tensor& bias) {
  elementwise("add_bias", {{"x", x}});
  auto d = common_device("add_bias", {{"x", x}, {"bias", bias}});
  need_vector("add_bias", {"bias", bias}, cols("add_bias", {"x", x}), {"x", x});
  TROUPE_DISPATCH(d, add_bias(x, bias));
}
void sum_rows(const tensor& x, const tensor& out) {
  elementwise("sum_rows", {{"x", x}});
  auto d = common_device("sum_rows", {{"x", x}, {"out", out}});
  need_vector("sum_rows", {"out", out}, cols("sum_rows", {"x", x}), {"x", x});
  TROUPE_DISPATCH(d, sum_rows(x, out));
}
double sum(const tensor& x) {
  elementwise("sum", {{"x", x}});
  TROUPE_DISPATCH(x.dev(), sum(x));
}
double sum_squares(const tensor& x) {
  elementwise("sum_squares", {{"x", x}});
  TROUPE_DISPATCH(x.dev(), sum_squares(x));
}
bool all_finite(const tensor& x) {
  elementwise("all_finite", {{"x", x}});
  TROUPE_DISPATCH(x.dev(), all_finite(x));
}

void gelu(const tensor& x, const tensor& y) {
  elementwise("gelu", {{"x", x}, {"y", y}});
  auto d = common_device("gelu", {{"x", x}, {"y", y}});
  TROUPE_DISPATCH(d, gelu(x, y));
}
void gelu_backward(const tensor& x, const tensor& dy, const tensor& dx) {
  elementwise("gelu_backward", {{"x", x}, {"dy", dy}, {"dx", dx}});
  auto d = common_device("gelu_backward", {{"x", x}, {"dy", dy}, {"dx", dx}});
  TROUPE_DISPATCH(d, gelu_backward(x, dy, dx));
}
void silu(const tensor& x, const tensor& y) {
  elementwise("silu", {{"x", x}, {"y", y}});
  auto d = common_device("silu", {{"x", x}, {"y", y}});
  TROUPE_DISPATCH(d, silu(x, y));
}
void silu_backward(const tensor& x, const tensor& dy, const tensor& dx) {
  elementwise("silu_backward", {{"x", x}, {"dy", dy}, {"dx", dx}});
  auto d = common_device("silu_backward", {{"x", x}, {"dy", dy}, {"dx", dx}});
  TROUPE_DISPATCH(d, silu_backward(x, dy, dx));
}
void swiglu(const tensor& gate, const tensor& up, const tensor& out) {
  elementwise("swiglu", {{"gate", gate}, {"up", up}, {"out", out}});
  auto d = common_device("swiglu", {{"gate", gate}, {"up", up}, {"out", out}});
  TROUPE_DISPATCH(d, swiglu(gate, up, out));
}
void swiglu_backward(const tensor& gate, const tensor& up, const tensor& dout, const tensor& dgate,
                     const tensor& dup) {
  elementwise("swiglu_backward",
              {{"gate", gate}, {"up", up}, {"dout", dout}, {"dgate", dgate}, {"dup", dup}});
  auto d =
      common_device("swiglu_backward",
                    {{"gate", gate}, {"up", up}, {"dout", dout}, {"dgate", dgate}, {"dup", dup}});
  TROUPE_DISPATCH(d, swiglu_backward(gate, up, dout, dgate, dup));
}

void softmax(const tensor& x, const tensor& y) {
  elementwise("softmax", {{"x", x}, {"y", y}});
  auto d = common_device("softmax", {{"x", x}, {"y", y}});
  TROUPE_DISPATCH(d, softmax(x, y));
}
void softmax_backward(const tensor& y, const tensor& dy, const tensor& dx) {
  elementwise("softmax_backward", {{"y", y}, {"dy", dy}, {"dx", dx}});
  auto d = common_device("softmax_backward", {{"y", y}, {"dy", dy}, {"dx", dx}});
  TROUPE_DISPATCH(d, softmax_backward(y, dy, dx));
}

void layernorm(const tensor& x, const tensor& w, const tensor& b, const tensor& y,
               const tensor& mean, const tensor& rstd, double eps) {
  const char* op = "layernorm";
  elementwise(op, {{"x", x}, {"y", y}});
  auto d =
      common_device(op, {{"x", x}, {"w", w}, {"b", b}, {"y", y}, {"mean", mean}, {"rstd", rstd}});
  std::int64_t c = cols(op, {"x", x});
  need_vector(op, {"w", w}, c, {"x", x});
  if (b.defined()) need_vector(op, {"b", b}, c, {"x", x});
  need_stat_vector(op, {"mean", mean}, rows(x), {"x", x});
  need_stat_vector(op, {"rstd", rstd}, rows(x), {"x", x});
  need_same_type(op, {"mean", mean}, {"rstd", rstd});
  TROUPE_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  TROUPE_DISPATCH(d, layernorm(x, w, b, y, mean, rstd, eps));
}
void layernorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& mean,
                        const tensor& rstd, const tensor& dx, const tensor& dw, const tensor& db) {
  const char* op = "layernorm_backward";
  elementwise(op, {{"x", x}, {"dy", dy}, {"dx", dx}});
  auto d = common_device(op, {{"dy", dy},
                              {"x", x},
                              {"w", w},
                              {"mean", mean},
                              {"rstd", rstd},
                              {"dx", dx},
                              {"dw", dw},
                              {"db", db}});
  std::int64_t c = cols(op, {"x", x});
  need_vector(op, {"w", w}, c, {"x", x});
  need_vector(op, {"dw", dw}, c, {"x", x});
  if (db.defined()) need_vector(op, {"db", db}, c, {"x", x});
  need_stat_vector(op, {"mean", mean}, rows(x), {"x", x});
  need_stat_vector(op, {"rstd", rstd}, rows(x), {"x", x});
  need_same_type(op, {"mean", mean}, {"rstd", rstd});
  TROUPE_DISPATCH(d, layernorm_backward(dy, x, w, mean, rstd, dx, dw, db));
}
void rmsnorm(const tensor& x, const tensor& w, const tensor& y, const tensor& rstd, double eps) {
  const char* op = "rmsnorm";
  elementwise(op, {{"x", x}, {"y", y}});
  auto d = common_device(op, {{"x", x}, {"w", w}, {"y", y}, {"rstd", rstd}});
  need_vector(op, {"w", w}, cols(op, {"x", x}), {"x", x});
  need_stat_vector(op, {"rstd", rstd}, rows(x), {"x", x});
  TROUPE_CHECK(eps >= 0, op, ": eps must be >= 0, got ", eps);
  TROUPE_DISPATCH(d, rmsnorm(x, w, y, rstd, eps));
}
void rmsnorm_backward(const tensor& dy, const tensor& x, const tensor& w, const tensor& rstd,
                      const tensor& dx, const tensor& dw) {
  const char* op = "rmsnorm_backward";
  elementwise(op, {{"x", x}, {"dy", dy}, {"dx", dx}});
  auto d =
      common_device(op, {{"dy", dy}, {"x", x}, {"w", w}, {"rstd", rstd}, {"dx", dx}, {"dw", dw}});
  std::int64_t c = cols(op, {"x", x});
  need_vector(op, {"w", w}, c, {"x", x});
  need_vector(op, {"dw", dw}, c, {"x", x});
  need_stat_vector(op, {"rstd", rstd}, rows(x), {"x", x});
  TROUPE_DISPATCH(d, rmsnorm_backward(dy, x, w, rstd, dx, dw));
}

void rope_tables(std::int64_t start, const rope_options& opt, const tensor& cos,
                 const tensor& sin) {
  const char* op = "rope_tables";
  elementwise(op, {{"cos", cos}, {"sin", sin}});
  auto d = common_device(op, {{"cos", cos}, {"sin", sin}});
  need_rank(op, {"cos", cos}, 2);
  TROUPE_CHECK(start >= 0, op, ": start must be >= 0, got ", start);
  TROUPE_CHECK(opt.theta > 0, op, ": theta must be > 0, got ", opt.theta);
  using scaling = rope_options::scaling;
  TROUPE_CHECK(opt.type == scaling::none || opt.factor > 0, op, ": factor must be > 0, got ",
               opt.factor);
  TROUPE_CHECK(opt.type != scaling::llama3 ||
                   (opt.low_freq_factor > 0 && opt.high_freq_factor > opt.low_freq_factor &&
                    opt.original_max_position > 0),
               op, ": llama3 scaling needs 0 < low_freq_factor < high_freq_factor and ",
               "original_max_position > 0, got ", opt.low_freq_factor, ", ", opt.high_freq_factor,
               " and ", opt.original_max_position);
  TROUPE_DISPATCH(d, rope_tables(start, opt, cos, sin));
}
void rope_tables(std::int64_t start, double theta, const tensor& cos, const tensor& sin) {
  rope_tables(start, rope_options{.theta = theta}, cos, sin);
}
void rope(const tensor& x, const tensor& cos, const tensor& sin, const tensor& y, bool inverse) {
  const char* op = "rope";
  auto d = common_device(op, {{"x", x}, {"cos", cos}, {"sin", sin}, {"y", y}});
  need_defined(op, {"x", x});
  need_defined(op, {"y", y});
  need_rank(op, {"x", x}, 4);
  need_same_shape(op, {"x", x}, {"y", y});
  need_float(op, {"x", x});
  need_same_type(op, {"x", x}, {"y", y});
  TROUPE_CHECK(x.last_dim_contiguous() && y.last_dim_contiguous(), op,
               ": x and y need a contiguous last dimension, got ", x.describe(), " and ",
               y.describe());
  std::int64_t t = x.size(1), dd = x.size(3);
  TROUPE_CHECK(dd % 2 == 0, op, ": head dimension must be even, got ", dd);
  for (const arg& a : {arg{"cos", cos}, arg{"sin", sin}}) {
    need_contiguous(op, a);
    need_same_type(op, {"x", x}, a);
    TROUPE_CHECK(a.t.dim() == 2 && a.t.size(0) >= t && a.t.size(1) == dd / 2, op, ": ", a.name,
                 " must be [T >= ", t, ", ", dd / 2, "], got ", a.t.describe());
  }
  TROUPE_DISPATCH(d, rope(x, cos, sin, y, inverse));
}

void embedding(const tensor& ids, const tensor& table, const tensor& out) {
  const char* op = "embedding";
  auto d = common_device(op, {{"ids", ids}, {"table", table}, {"out", out}});
  need_contiguous(op, {"ids", ids});
  need_contiguous(op, {"table", table});
  need_contiguous(op, {"out", out});
  TROUPE_CHECK(ids.type() == dtype::i32 || ids.type() == dtype::i64, op,
               ": ids must be i32 or i64, got ", ids.describe());
  need_rank(op, {"table", table}, 2);
  need_float(op, {"table", table});
  need_same_type(op, {"table", table}, {"out", out});
  TROUPE_CHECK(out.numel() == ids.numel() * table.size(1) && out.size(-1) == table.size(1), op,
               ": out must be [", ids.numel(), ", ", table.size(1), "], got ", out.describe());
  TROUPE_DISPATCH(d, embedding(ids, table, out));
}
void embedding_backward(const tensor& ids, const tensor& dout, const tensor& dtable) {
  const char* op = "embedding_backward";
  auto d = common_device(op, {{"ids", ids}, {"dout", dout}, {"dtable", dtable}});
  need_contiguous(op, {"ids", ids});
  need_contiguous(op, {"dout", dout});
  need_contiguous(op, {"dtable", dtable});
  TROUPE_CHECK(ids.type() == dtype::i32 || ids.type() == dtype::i64, op,
               ": ids must be i32 or i64, got ", ids.describe());
  need_rank(op, {"dtable", dtable}, 2);
  need_same_type(op, {"dtable", dtable}, {"dout", dout});
  TROUPE_CHECK(dout.numel() == ids.numel() * dtable.size(1) && dout.size(-1) == dtable.size(1), op,
               ": dout must be [", ids.numel(), ", ", dtable.size(1), "], got ", dout.describe());
  TROUPE_DISPATCH(d, embedding_backward(ids, dout, dtable));
}

std::int64_t cross_entropy(const tensor& logits, const tensor& targets, const tensor& losses,
                           const tensor& dlogits, double grad_scale, std::int64_t ignore_index) {
  const char* op = "cross_entropy";
  auto d = common_device(
      op, {{"logits", logits}, {"targets", targets}, {"losses", losses}, {"dlogits", dlogits}});
  need_contiguous(op, {"logits", logits});
  need_float(op, {"logits", logits});
  std::int64_t n = rows(logits);
  need_contiguous(op, {"targets", targets});
  TROUPE_CHECK(targets.type() == dtype::i32 || targets.type() == dtype::i64, op,
               ": targets must be i32 or i64, got ", targets.describe());
  TROUPE_CHECK(targets.numel() == n, op, ": targets has ", targets.numel(), " elements but logits ",
               logits.describe(), " has ", n, " rows");
  need_stat_vector(op, {"losses", losses}, n, {"logits", logits});
  if (dlogits.defined()) {
    need_contiguous(op, {"dlogits", dlogits});
    need_same_type(op, {"logits", logits}, {"dlogits", dlogits});
    need_same_shape(op, {"logits", logits}, {"dlogits", dlogits});
  }
  TROUPE_DISPATCH(d, cross_entropy(logits, targets, losses, dlogits, grad_scale, ignore_index));
}

void matmul(const tensor& a, const tensor& b, const tensor& c, double alpha, double beta) {
  const char* op = "matmul";
  auto d = common_device(op, {{"a", a}, {"b", b}, {"c", c}});
  for (const arg& x : {arg{"a", a}, arg{"b", b}, arg{"c", c}}) {
    need_defined(op, x);
    need_rank(op, x, 2);
    need_float(op, x);
  }
  need_same_type(op, {"a", a}, {"b", b});
  need_same_type(op, {"a", a}, {"c", c});
  TROUPE_CHECK(a.size(1) == b.size(0), op, ": inner dimensions differ: a is ", a.describe(),
               ", b is ", b.describe());
  TROUPE_CHECK(c.size(0) == a.size(0) && c.size(1) == b.size(1), op, ": c must be [", a.size(0),
               ", ", b.size(1), "], got ", c.describe());
  for (const arg& x : {arg{"a", a}, arg{"b", b}})
    TROUPE_CHECK(x.t.stride(1) == 1 || x.t.stride(0) == 1 || x.t.numel() == 0, op, ": ", x.name,
                 " needs a unit stride in one dimension, got ", x.t.describe());
  TROUPE_CHECK(c.stride(1) == 1 || c.size(1) <= 1, op, ": c needs a unit last stride, got ",
               c.describe());
  TROUPE_DISPATCH(d, matmul(a, b, c, alpha, beta));
}

namespace {
void check_attention(const char* op, const tensor& q, const tensor& k, const tensor& v,
                     const tensor& out, const tensor& lse) {
  for (const arg& x : {arg{"q", q}, arg{"k", k}, arg{"v", v}, arg{"out", out}}) {
    need_defined(op, x);
    need_rank(op, x, 4);
    need_float(op, x);
    need_same_type(op, {"q", q}, x);
    TROUPE_CHECK(x.t.last_dim_contiguous(), op, ": ", x.name,
                 " needs a contiguous last dimension, got ", x.t.describe());
  }
  need_same_shape(op, {"q", q}, {"out", out});
  need_same_shape(op, {"k", k}, {"v", v});
  TROUPE_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), op,
               ": q [B, T, Hq, D] and k [B, S, Hkv, D] disagree: q is ", q.describe(), ", k is ",
               k.describe());
  TROUPE_CHECK(k.size(2) > 0 && q.size(2) % k.size(2) == 0, op, ": query heads (", q.size(2),
               ") must be a multiple of key/value heads (", k.size(2), ")");
  TROUPE_CHECK(k.size(1) >= q.size(1), op, ": fewer keys (", k.size(1), ") than queries (",
               q.size(1), ")");
  need_stat_type(op, {"lse", lse}, {"q", q});
  TROUPE_CHECK(lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(2) &&
                   lse.size(2) == q.size(1),
               op, ": lse must be [", q.size(0), ", ", q.size(2), ", ", q.size(1), "], got ",
               lse.describe());
}

// Packed rows: segments i32 [B, T], T == S, each row non-decreasing (contiguous documents).
void check_segments(const char* op, const tensor& q, const tensor& k, const tensor& seg) {
  if (!seg.defined()) return;
  TROUPE_CHECK(seg.type() == dtype::i32 && seg.dim() == 2 && seg.size(0) == q.size(0) &&
                   seg.size(1) == q.size(1) && seg.is_contiguous(),
               op, ": segments must be contiguous i32 [", q.size(0), ", ", q.size(1), "], got ",
               seg.describe());
  TROUPE_CHECK(k.size(1) == q.size(1), op, ": segments need as many keys as queries, got ",
               k.size(1), " keys and ", q.size(1), " queries");
  if (!seg.is_cpu()) return;
  const auto* p = seg.data_as<std::int32_t>();
  for (std::int64_t b = 0; b < seg.size(0); ++b)
    for (std::int64_t t = 1; t < seg.size(1); ++t)
      TROUPE_CHECK(p[b * seg.size(1) + t] >= p[b * seg.size(1) + t - 1], op,
                   ": segments must not decrease along a row, row ", b, " has ",
                   p[b * seg.size(1) + t - 1], " then ", p[b * seg.size(1) + t], " at ", t);
}
}  // namespace

const char* attention_kernel_for(const tensor& q, const attention_options& opt) {
  TROUPE_CHECK(q.dim() == 4, "attention_kernel_for: q must be [B, T, Hq, D], got ", q.describe());
  if (q.is_cpu()) return "cpu";
#if defined(TROUPE_HAVE_CUDA)
  return cuda::attention_kernel_for(q, opt);
#else
  TROUPE_FAIL("tensor on ", to_string(q.dev()), " but troupe was built without CUDA");
#endif
}

void attention(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
               const tensor& lse, const attention_options& opt) {
  auto d = common_device("attention", {{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"lse", lse}});
  check_attention("attention", q, k, v, out, lse);
  check_segments("attention", q, k, opt.segments);
  TROUPE_DISPATCH(d, attention(q, k, v, out, lse, opt));
}
void attention_backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                        const tensor& dout, const tensor& lse, const tensor& dq, const tensor& dk,
                        const tensor& dv, const attention_options& opt) {
  const char* op = "attention_backward";
  auto d = common_device(op, {{"q", q},
                              {"k", k},
                              {"v", v},
                              {"out", out},
                              {"dout", dout},
                              {"lse", lse},
                              {"dq", dq},
                              {"dk", dk},
                              {"dv", dv}});
  check_attention(op, q, k, v, out, lse);
  check_segments(op, q, k, opt.segments);
  for (auto [g, x] : {std::pair<arg, arg>{{"dout", dout}, {"out", out}},
                      {{"dq", dq}, {"q", q}},
                      {{"dk", dk}, {"k", k}},
                      {{"dv", dv}, {"v", v}}}) {
    need_defined(op, g);
    need_same_shape(op, x, g);
    need_same_type(op, x, g);
    TROUPE_CHECK(g.t.last_dim_contiguous(), op, ": ", g.name,
                 " needs a contiguous last dimension, got ", g.t.describe());
  }
  TROUPE_DISPATCH(d, attention_backward(q, k, v, out, dout, lse, dq, dk, dv, opt));
}

void adamw(const tensor& param, const tensor& grad, const tensor& m, const tensor& v,
           const adamw_options& opt) {
  const char* op = "adamw";
  elementwise(op, {{"param", param}, {"grad", grad}, {"m", m}, {"v", v}});
  auto d = common_device(op, {{"param", param}, {"grad", grad}, {"m", m}, {"v", v}});
  TROUPE_CHECK(opt.step >= 1, op, ": step must be >= 1, got ", opt.step);
  TROUPE_CHECK(opt.beta1 >= 0 && opt.beta1 < 1 && opt.beta2 >= 0 && opt.beta2 < 1, op,
               ": betas must be in [0, 1), got ", opt.beta1, ", ", opt.beta2);
  TROUPE_DISPATCH(d, adamw(param, grad, m, v, opt));
}

}  // namespace troupe::ops
