// Tensor-parallel layers: forward and backward of each shard with its region's collectives (see
// tp_layers.hpp).
#include "models/parallel/tp_layers.hpp"

#include <type_traits>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {

// `s` with dimension 1 (the sequence) multiplied by `factor`.
shape with_seq_times(shape s, std::int64_t factor) {
  s[1] *= factor;
  return s;
}

// The sequence length a shard holds: b.seq / tp with SP (checked), else b.seq.
void check_sequence(const tp_group& g, batch_dims b, const std::string& owner) {
  if (g.sequence_parallel) divide_by_tp(b.seq, g.size(), owner + ": sequence length");
}

void check_sp_input(const tp_group& g, const tensor& x, const std::string& owner) {
  TROUPE_CHECK(!g.sequence_parallel || (x.defined() && x.dim() == 3), owner,
               ": with sequence parallelism x must be [B, T/tp, C], got ", describe(x));
}

}  // namespace

// ---- tp_entry ---------------------------------------------------------------------------------

void tp_entry::declare(slot_list& s, batch_dims b, std::int64_t width, const std::string& owner) {
  label = owner;
  dim = width;
  if (!tp.sequence_parallel) return;
  s.activation("tp_x_full", {b.batch, b.seq, width}, x_full);
  s.scratch("tp_dx_full", {b.batch, b.seq, width}, dx_full);
  s.scratch("tp_entry_buf", {b.batch * b.seq * width}, scratch);
}

tensor tp_entry::forward(const tensor& x) {
  if (!tp.sequence_parallel) return x;
  check_sp_input(tp, x, label);
  tensor xf = planned_view(x_full, with_seq_times(x.sizes(), tp.size()), label, "tp_x_full");
  gather_sequence(tp, x, xf, scratch);
  return xf;
}

tensor tp_entry::grad_buffer(const tensor& dx) const {
  if (!dx.defined() || !tp.sequence_parallel) return dx;
  return planned_view(dx_full, with_seq_times(dx.sizes(), tp.size()), label, "tp_dx_full");
}

void tp_entry::backward(const tensor& dx_region, const tensor& dx) {
  if (!dx.defined()) return;
  if (!tp.sequence_parallel)
    allreduce_sum(tp, dx);  // copy_to_region's backward
  else
    reduce_scatter_sequence(tp, dx_region, dx, scratch);  // gather_from_sequence's backward
}

// ---- tp_exit ----------------------------------------------------------------------------------

void tp_exit::declare(slot_list& s, batch_dims b, std::int64_t width, bool with_bias,
                      std::string_view bias_scope, const std::string& owner) {
  label = owner;
  dim = width;
  has_bias = with_bias;
  if (has_bias) {
    auto sc = s.enter(bias_scope);
    s.param("bias", {width}, bias, dbias, param_spec::replicated(param_init::zeros));
  }
  if (!tp.sequence_parallel) return;
  s.scratch("tp_exit_full", {b.batch, b.seq, width}, full);
  s.scratch("tp_exit_buf", {b.batch * b.seq * width}, scratch);
  if (has_bias) s.scratch("tp_dbias_part", {width}, dbias_part);
}

tensor tp_exit::partial_buffer(const tensor& y) const {
  if (!tp.sequence_parallel) return y;
  check_sp_input(tp, y, label);
  return planned_view(full, with_seq_times(y.sizes(), tp.size()), label, "tp_exit_full");
}

void tp_exit::forward(const tensor& partial, const tensor& y) {
  if (!tp.sequence_parallel)
    allreduce_sum(tp, y);  // reduce_from_region (partial is y)
  else
    reduce_scatter_sequence(tp, partial, y, scratch);  // reduce_scatter_to_sequence
  if (has_bias && y.numel() > 0) ops::add_bias(y.reshape({y.numel() / dim, dim}), bias);
}

tensor tp_exit::backward(const tensor& dy) {
  if (has_bias && dy.numel() > 0) {
    tensor dy2 = dy.reshape({dy.numel() / dim, dim});
    if (!tp.sequence_parallel) {
      ops::sum_rows(dy2, dbias);  // dy is replicated: every shard adds the full sum
    } else {                      // each shard holds some rows: sum the partial sums over the group
      ops::fill(dbias_part, 0.0);
      ops::sum_rows(dy2, dbias_part);
      allreduce_sum(tp, dbias_part);
      ops::axpy(1.0, dbias_part, dbias);
    }
  }
  if (!tp.sequence_parallel) return dy;  // reduce_from_region's backward: identity
  tensor df = planned_view(full, with_seq_times(dy.sizes(), tp.size()), label, "tp_exit_full");
  gather_sequence(tp, dy, df, scratch);
  return df;
}

void tp_exit::forward_full_sequence(const tensor& y) {
  allreduce_sum(tp, y);  // reduce_from_region
  if (has_bias && y.numel() > 0) ops::add_bias(y.reshape({y.numel() / dim, dim}), bias);
}

// ---- column_parallel_linear -------------------------------------------------------------------

column_parallel_linear::column_parallel_linear(const config& c, tp_group g)
    : cfg(c),
      tp(g),
      local({c.in, divide_by_tp(c.out, g.size(), "column_parallel_linear: out features"), c.bias,
             tp_split::column}) {
  TROUPE_CHECK(!(c.gather_output && g.sequence_parallel),
               "column_parallel_linear: gather_output cannot be combined with sequence "
               "parallelism");
  entry.tp = g;
}

void column_parallel_linear::declare(slot_list& s, std::string_view name, batch_dims b) {
  auto sc = s.enter(name);
  label = "column_parallel_linear '" + s.prefix() + "'";
  check_sequence(tp, b, label);
  entry.declare(s, b, cfg.in, label);
  if (cfg.gather_output) {
    s.scratch("tp_y_local", {b.rows(), local.cfg.out}, y_local);
    s.scratch("tp_dy_local", {b.rows(), local.cfg.out}, dy_local);
    s.scratch("tp_gather_buf", {b.rows() * cfg.out}, scratch);
  }
  local.declare(s, "", b);
  local.label = label;
}

void column_parallel_linear::forward(const tensor& x, const tensor& y) {
  tensor xf = entry.forward(x);
  if (!cfg.gather_output) {
    local.forward(xf, y);
    return;
  }
  TROUPE_CHECK(y.defined() && y.sizes() == with_last(xf.sizes(), cfg.out), label, ": y must be ",
               with_last(xf.sizes(), cfg.out).str(), ", got ", describe(y));
  tensor yl = planned_view(y_local, with_last(xf.sizes(), local.cfg.out), label, "tp_y_local");
  local.forward(xf, yl);
  gather_last_dim(tp, yl, y, scratch);
}

void column_parallel_linear::backward(const tensor& dy, const tensor& dx) {
  tensor dxr = entry.grad_buffer(dx);
  if (!cfg.gather_output) {
    local.backward(dy, dxr);
  } else {
    std::int64_t o = local.cfg.out;
    tensor dyl = planned_view(dy_local, with_last(dy.sizes(), o), label, "tp_dy_local");
    ops::copy(dy.narrow(dy.dim() - 1, tp.rank() * o, o), dyl);
    local.backward(dyl, dxr);
  }
  entry.backward(dxr, dx);
}

void column_parallel_linear::load_from(const linear& full) {
  TROUPE_CHECK(full.cfg.in == cfg.in && full.cfg.out == cfg.out && full.cfg.bias == cfg.bias, label,
               ": load_from needs a linear ", cfg.in, " -> ", cfg.out);
  copy_shard(full.weight, 0, tp.rank(), tp.size(), local.weight);
  if (cfg.bias) copy_shard(full.bias, 0, tp.rank(), tp.size(), local.bias);
}

// ---- row_parallel_linear ----------------------------------------------------------------------

row_parallel_linear::row_parallel_linear(const config& c, tp_group g)
    : cfg(c),
      tp(g),
      local({divide_by_tp(c.in, g.size(), "row_parallel_linear: in features"), c.out, false,
             tp_split::row}) {
  exit.tp = g;
}

void row_parallel_linear::declare(slot_list& s, std::string_view name, batch_dims b) {
  auto sc = s.enter(name);
  label = "row_parallel_linear '" + s.prefix() + "'";
  check_sequence(tp, b, label);
  exit.declare(s, b, cfg.out, cfg.bias, "", label);
  local.declare(s, "", b);
  local.label = label;
}

void row_parallel_linear::forward(const tensor& x, const tensor& y) {
  tensor p = exit.partial_buffer(y);
  local.forward(x, p);
  exit.forward(p, y);
}

void row_parallel_linear::backward(const tensor& dy, const tensor& dx) {
  local.backward(exit.backward(dy), dx);
}

void row_parallel_linear::load_from(const linear& full) {
  TROUPE_CHECK(full.cfg.in == cfg.in && full.cfg.out == cfg.out && full.cfg.bias == cfg.bias, label,
               ": load_from needs a linear ", cfg.in, " -> ", cfg.out);
  copy_shard(full.weight, 1, tp.rank(), tp.size(), local.weight);
  if (cfg.bias) ops::copy(full.bias, exit.bias);
}

// ---- tp_mlp -----------------------------------------------------------------------------------

tp_mlp::tp_mlp(const mlp::config& c, tp_group g)
    : cfg(c),
      tp(g),
      fc({.in = c.dim, .out = c.hidden, .bias = c.bias}, g),
      proj({.in = c.hidden, .out = c.dim, .bias = c.bias}, g) {}

void tp_mlp::declare(slot_list& s, std::string_view name, batch_dims b) {
  auto sc = s.enter(name);
  label = "tp_mlp '" + s.prefix() + "'";
  fc.declare(s, "fc", b);
  proj.declare(s, "proj", b);
  std::int64_t hl = fc.local.cfg.out;
  s.activation("h", {b.rows(), hl}, h);
  s.activation("a", {b.rows(), hl}, a);
  s.scratch("da", {b.rows(), hl}, da);
  s.scratch("dh", {b.rows(), hl}, dh);
}

void tp_mlp::forward(const tensor& x, const tensor& y) {
  check_sp_input(tp, x, label);
  shape full = tp.sequence_parallel ? with_seq_times(x.sizes(), tp.size()) : x.sizes();
  shape hs = with_last(full, fc.local.cfg.out);
  tensor hv = planned_view(h, hs, label, "h"), av = planned_view(a, hs, label, "a");
  fc.forward(x, hv);
  ops::gelu(hv, av);
  proj.forward(av, y);
}

void tp_mlp::backward(const tensor& dy, const tensor& dx) {
  TROUPE_CHECK(fc.local.x.defined(), label, ": backward called before forward");
  shape hs = with_last(fc.local.x.sizes(), fc.local.cfg.out);
  tensor dav = planned_view(da, hs, label, "da"), dhv = planned_view(dh, hs, label, "dh");
  proj.backward(dy, dav);
  ops::gelu_backward(planned_view(h, hs, label, "h"), dav, dhv);
  fc.backward(dhv, dx);
}

void tp_mlp::forward_step(const tensor& x, const tensor& y) {
  TROUPE_CHECK(x.defined() && x.dim() == 3, label, ": a step's x must be [B, t, C], got ",
               describe(x));
  shape hs = with_last(x.sizes(), fc.local.cfg.out);
  tensor hv = planned_view(h, hs, label, "h"), av = planned_view(a, hs, label, "a");
  fc.local.forward(x, hv);  // entered by identity: x is whole on every shard
  ops::gelu(hv, av);
  proj.local.forward(av, y);
  proj.exit.forward_full_sequence(y);
}

void tp_mlp::load_from(const mlp& full) {
  fc.load_from(full.fc);
  proj.load_from(full.proj);
}

// ---- tp_attention -----------------------------------------------------------------------------

namespace {

attention::config local_attention(attention::config c, int tp) {
  if (c.n_kv_head == 0) c.n_kv_head = c.n_head;
  if (c.head_dim == 0 && c.n_head > 0) c.head_dim = c.dim / c.n_head;
  c.n_head = divide_by_tp(c.n_head, tp, "tp_attention: n_head (query heads)");
  c.n_kv_head = divide_by_tp(c.n_kv_head, tp, "tp_attention: n_kv_head (key/value heads)");
  c.out_bias = false;  // added once, after the reduction
  return c;
}

}  // namespace

tp_attention::tp_attention(const attention::config& c, tp_group g)
    : tp(g), local(local_attention(c, g.size())) {
  cfg = c;
  if (cfg.n_kv_head == 0) cfg.n_kv_head = cfg.n_head;
  if (cfg.head_dim == 0 && cfg.n_head > 0) cfg.head_dim = cfg.dim / cfg.n_head;
  entry.tp = g;
  exit.tp = g;
}

void tp_attention::declare(slot_list& s, std::string_view name, batch_dims b) {
  auto sc = s.enter(name);
  label = "tp_attention '" + s.prefix() + "'";
  check_sequence(tp, b, label);
  entry.declare(s, b, cfg.dim, label);
  exit.declare(s, b, cfg.dim, cfg.out_bias, "o_proj", label);
  local.declare(s, "", b);
}

void tp_attention::forward(const tensor& x, const tensor& y) {
  region_forward(entry, local, exit, x, y);
}

void tp_attention::backward(const tensor& dy, const tensor& dx) {
  region_backward(entry, local, exit, dy, dx);
}

void tp_attention::forward_step(const tensor& x, const tensor& y, const kv_layer& cache,
                                std::int64_t start) {
  attention_step(local, x, y, cache, start);  // entered by identity; y: the partial o_proj
  exit.forward_full_sequence(y);
}

void tp_attention::load_from(const attention& full) {
  TROUPE_CHECK(full.cfg.dim == cfg.dim && full.cfg.n_head == cfg.n_head &&
                   full.cfg.n_kv_head == cfg.n_kv_head && full.cfg.head_dim == cfg.head_dim &&
                   full.cfg.fused_qkv == cfg.fused_qkv,
               label, ": load_from needs an attention of the same sizes");
  int r = tp.rank(), n = tp.size();
  if (cfg.fused_qkv) {
    copy_qkv_shard(full.qkv_proj.weight, cfg.n_head, cfg.n_kv_head, cfg.head_dim, r, n,
                   local.qkv_proj.weight);
    if (cfg.qkv_bias)
      copy_qkv_shard(full.qkv_proj.bias, cfg.n_head, cfg.n_kv_head, cfg.head_dim, r, n,
                     local.qkv_proj.bias);
  } else {
    copy_shard(full.q_proj.weight, 0, r, n, local.q_proj.weight);
    copy_shard(full.k_proj.weight, 0, r, n, local.k_proj.weight);
    copy_shard(full.v_proj.weight, 0, r, n, local.v_proj.weight);
    if (cfg.qkv_bias) {
      copy_shard(full.q_proj.bias, 0, r, n, local.q_proj.bias);
      copy_shard(full.k_proj.bias, 0, r, n, local.k_proj.bias);
      copy_shard(full.v_proj.bias, 0, r, n, local.v_proj.bias);
    }
  }
  copy_shard(full.o_proj.weight, 1, r, n, local.o_proj.weight);
  if (cfg.out_bias) ops::copy(full.o_proj.bias, exit.bias);
}

// ---- sp_norm ----------------------------------------------------------------------------------

namespace {
template <class Norm>
constexpr bool norm_has_bias = std::is_same_v<Norm, layernorm>;
}  // namespace

template <class Norm>
void sp_norm<Norm>::declare(slot_list& s, std::string_view name, batch_dims b) {
  if (tp.sequence_parallel)
    b.seq = divide_by_tp(b.seq, tp.size(), "sp_norm '" + std::string(name) + "': sequence length");
  norm.declare(s, name, b);
  if (!tp.sequence_parallel) return;
  auto sc = s.enter(name);
  s.scratch("tp_dweight_part", {norm.cfg.dim}, dw_part);
  if constexpr (norm_has_bias<Norm>)
    if (norm.cfg.bias) s.scratch("tp_dbias_part", {norm.cfg.dim}, db_part);
}

template <class Norm>
void sp_norm<Norm>::backward(const tensor& dy, const tensor& dx) {
  if (!tp.sequence_parallel) {  // replicated rows: every shard computes the full gradients
    norm.backward(dy, dx);
    return;
  }
  // The shard's rows give partial weight gradients: compute them apart, sum over the group, add.
  tensor dw = norm.dweight, db;
  ops::fill(dw_part, 0.0);
  norm.dweight = dw_part;
  if constexpr (norm_has_bias<Norm>) {
    db = norm.dbias;
    if (db.defined()) ops::fill(db_part, 0.0);
    norm.dbias = db_part;
  }
  norm.backward(dy, dx);
  norm.dweight = dw;
  if constexpr (norm_has_bias<Norm>) norm.dbias = db;
  allreduce_sum(tp, dw_part);
  ops::axpy(1.0, dw_part, dw);
  if (db.defined()) {
    allreduce_sum(tp, db_part);
    ops::axpy(1.0, db_part, db);
  }
}

template <class Norm>
void sp_norm<Norm>::load_from(const Norm& full) {
  ops::copy(full.weight, norm.weight);
  if constexpr (norm_has_bias<Norm>)
    if (norm.cfg.bias) ops::copy(full.bias, norm.bias);
}

template struct sp_norm<layernorm>;
template struct sp_norm<rmsnorm>;

// ---- tp_gpt_block -----------------------------------------------------------------------------

tp_gpt_block::tp_gpt_block(const gpt_block::config& c, tp_group g)
    : tp(g),
      ln_1({.dim = c.dim, .eps = c.ln_eps}, g),
      ln_2({.dim = c.dim, .eps = c.ln_eps}, g),
      attn({.dim = c.dim, .n_head = c.n_head, .n_kv_head = c.n_kv_head, .rope = c.rope}, g),
      ff({.dim = c.dim, .hidden = c.hidden == 0 ? 4 * c.dim : c.hidden}, g) {}

void tp_gpt_block::declare(slot_list& s, std::string_view name, batch_dims b, bool recompute) {
  auto sc = recompute ? s.enter_recomputed(name) : s.enter(name);
  std::string label = "tp_gpt_block '" + s.prefix() + "'";
  check_sequence(tp, b, label);
  ln_1.declare(s, "ln_1", b);
  attn.declare(s, "attn", b);
  ln_2.declare(s, "ln_2", b);
  ff.declare(s, "mlp", b);
  buf.declare(s, shard_rows(b, ln_1.norm.cfg.dim, tp, label));
}

void tp_gpt_block::forward(const tensor& x, const tensor& y) {
  residual_forward(ln_1, attn, ln_2, ff, buf, x, y, "tp_gpt_block");
}

void tp_gpt_block::recompute(const tensor& x) {
  forward(x, tensor{});
}

void tp_gpt_block::backward(const tensor& dy, const tensor& dx) {
  residual_backward(ln_1, attn, ln_2, ff, buf, dy, dx, "tp_gpt_block");
}

void tp_gpt_block::forward_step(const tensor& x, const tensor& y, const kv_layer& cache,
                                std::int64_t start) {
  cached_region<tp_attention> step{attn, cache, start};
  region_step<tp_mlp> mlp_step{ff};
  residual_forward(ln_1, step, ln_2, mlp_step, buf, x, y, "tp_gpt_block");
}

void tp_gpt_block::load_from(const gpt_block& full) {
  ln_1.load_from(full.ln_1);
  ln_2.load_from(full.ln_2);
  attn.load_from(full.attn);
  ff.load_from(full.ff);
}

}  // namespace troupe::models
