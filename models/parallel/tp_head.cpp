// tp_head: a shard's final norm, head and vocab-parallel loss (see tp_head.hpp).
#include "models/parallel/tp_head.hpp"

#include <utility>

#include "memory/error.hpp"
#include "models/parallel/vocab_entropy.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

template <class Norm>
tp_head<Norm>::tp_head(const config& c, tp_group g)
    : cfg(c), tp(g), norm(c.norm, g), loss({.vocab = c.vocab}, g) {
  entry.tp = g;
}

template <class Norm>
void tp_head<Norm>::declare(slot_list& s, batch_dims b, std::string_view weight_scope) {
  norm.declare(s, cfg.norm_name, b);
  if (!weight_scope.empty()) {
    auto sc = s.enter(weight_scope);
    param_spec spec = param_spec::split_along(0);
    spec.embedding = cfg.tied;  // a copy of the token embedding (a pipeline's last stage)
    s.param("weight", {local_vocab(), cfg.dim}, weight, dweight, std::move(spec));
  }
  {
    auto sc = s.enter("head");
    entry.declare(s, b, cfg.dim, "tp head");
  }
  std::int64_t seq = tp.sequence_parallel ? b.seq / tp.size() : b.seq;
  s.activation(cfg.norm_out_name, {b.batch, seq, cfg.dim}, norm_out_);
  s.activation("logits", {b.rows(), local_vocab()}, logits_);
  loss.declare(s, "loss", b);
}

template <class Norm>
double tp_head<Norm>::forward(const tensor& x, const tensor& targets) {
  TROUPE_CHECK(x.defined() && x.dim() == 3, "tp head: x must be [B, T, C], got ", describe(x));
  b_ = x.size(0);
  t_ = tp.sequence_parallel ? x.size(1) * tp.size() : x.size(1);
  TROUPE_CHECK(targets.numel() == b_ * t_, "tp head: targets ", describe(targets),
               " do not match [", b_, ", ", t_, "]");
  norm_cur_ = planned_view(norm_out_, x.sizes(), "tp head", cfg.norm_out_name.c_str());
  norm.forward(x, norm_cur_);
  tensor hf = entry.forward(norm_cur_);  // [B, T, C] (SP: gathered)
  logits_cur_ = planned_view(logits_, {b_ * t_, local_vocab()}, "tp head", "logits");
  ops::matmul(hf.reshape({b_ * t_, cfg.dim}), weight.transpose(0, 1), logits_cur_);
  const double mean = loss.forward(logits_cur_, targets.reshape({b_ * t_}));
  if (!objective) {
    loss.row_weights.clear();
    return mean;
  }
  token_loss r = objective(loss.token_logprobs());
  TROUPE_CHECK(static_cast<std::int64_t>(r.dlogp.size()) == b_ * t_,
               "tp head: the token objective gave ", r.dlogp.size(), " gradients for ", b_ * t_,
               " positions");
  if (r.on_entropy) r.on_entropy(vocab_parallel_entropy(logits_cur_, tp));
  for (auto& d : r.dlogp) d = -d;  // logp_n = -loss_n
  loss.row_weights = std::move(r.dlogp);
  return r.loss;
}

template <class Norm>
void tp_head<Norm>::backward(double loss_scale, const tensor& scratch, const tensor& dx) {
  TROUPE_CHECK(b_ > 0, "tp head: backward called before forward");
  loss.backward(logits_cur_, loss_scale);  // the logits become their gradient
  tensor hf = tp.sequence_parallel
                  ? planned_view(entry.x_full, {b_, t_, cfg.dim}, "tp head", "head x_full")
                  : norm_cur_;
  // dW += dlogits^T hf; d(hf) = dlogits W (a partial sum over the shards' vocabularies).
  ops::matmul(logits_cur_.transpose(0, 1), hf.reshape({b_ * t_, cfg.dim}), dweight, 1.0, 1.0);
  tensor dhf = entry.grad_buffer(scratch);
  ops::matmul(logits_cur_, weight, dhf.reshape({b_ * t_, cfg.dim}));
  entry.backward(dhf, scratch);
  norm.backward(scratch, dx);
}

template <class Norm>
void tp_head<Norm>::last_logits(const tensor& x, const tensor& logits) {
  TROUPE_CHECK(x.defined() && x.dim() == 3, "tp head: a step's x must be [B, t, C], got ",
               describe(x));
  const std::int64_t b = x.size(0), t = x.size(1);
  const shape want{b, local_vocab()};
  TROUPE_CHECK(logits.defined() && logits.sizes() == want, "tp head: a step's logits must be [", b,
               ", ", local_vocab(), "], got ", describe(logits));
  tensor hn = planned_view(norm_out_, x.sizes(), "tp head", cfg.norm_out_name.c_str());
  norm.forward(x, hn);
  ops::matmul(hn.select(1, t - 1), weight.transpose(0, 1), logits);
}

template struct tp_head<layernorm>;
template struct tp_head<rmsnorm>;

}  // namespace troupe::models
