// token_logprob: per-token log-probabilities and their gradient (token_logprob.hpp).
#include "models/post/token_logprob.hpp"

#include "memory/error.hpp"
#include "models/layers/slots.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

std::int64_t rows_of(const tensor& logits, const tensor& targets, const tensor& losses,
                     bool all_rows) {
  TROUPE_CHECK(logits.defined() && logits.dim() == 2, "token_logprobs: logits must be [N, V], got ",
               describe(logits));
  const std::int64_t n = logits.size(0);
  TROUPE_CHECK(targets.defined() && targets.numel() == n, "token_logprobs: targets must have ", n,
               " rows, got ", describe(targets));
  const std::int64_t need = all_rows ? n : 1;
  TROUPE_CHECK(losses.defined() && losses.numel() >= need, "token_logprobs: losses must have ",
               need, " rows, got ", describe(losses));
  return n;
}

}  // namespace

std::vector<double> token_logprobs(const tensor& logits, const tensor& targets,
                                   const tensor& losses, std::int64_t ignore_index) {
  const std::int64_t n = rows_of(logits, targets, losses, true);
  tensor l = losses.reshape({losses.numel()}).narrow(0, 0, n);
  ops::cross_entropy(logits, targets.reshape({n}), l, tensor{}, 0.0, ignore_index);
  // The op writes 0 for ignored rows, so -loss is the log-probability everywhere.
  owned_tensor host;
  if (!l.is_cpu()) host = to_device(l, device::cpu());
  const tensor& src = l.is_cpu() ? l : host;
  owned_tensor wide = empty({n}, dtype::f64);
  ops::copy(src, wide);
  const auto* p = wide.data_as<double>();
  std::vector<double> out(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) out[static_cast<std::size_t>(i)] = -p[i];
  return out;
}

void token_logprobs_backward(const tensor& logits, const tensor& targets,
                             std::span<const double> dlogp, const tensor& losses,
                             const tensor& dlogits, std::int64_t ignore_index) {
  const std::int64_t n = rows_of(logits, targets, losses, false);
  TROUPE_CHECK(static_cast<std::int64_t>(dlogp.size()) == n, "token_logprobs_backward: ", n,
               " rows but ", dlogp.size(), " gradients");
  TROUPE_CHECK(dlogits.defined() && dlogits.sizes() == logits.sizes(),
               "token_logprobs_backward: dlogits must be like the logits ", logits.sizes().str(),
               ", got ", describe(dlogits));
  tensor tg = targets.reshape({n});
  tensor l = losses.reshape({losses.numel()});
  // One row at a time: each row has its own scale. d(logp)/dlogits = -(softmax - onehot).
  for (std::int64_t i = 0; i < n; ++i)
    ops::cross_entropy(logits.narrow(0, i, 1), tg.narrow(0, i, 1), l.narrow(0, 0, 1),
                       dlogits.narrow(0, i, 1), -dlogp[static_cast<std::size_t>(i)], ignore_index);
}

}  // namespace troupe::models
