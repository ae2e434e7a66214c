// sequence_logprob: per-sequence log-probabilities and their gradient (sequence_logprob.hpp).
#include "models/post/sequence_logprob.hpp"

#include "memory/error.hpp"
#include "models/layers/slots.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

std::int64_t sequences(const tensor& logits, const tensor& targets, std::int64_t seq,
                       const tensor& losses) {
  TROUPE_CHECK(logits.defined() && logits.dim() == 2,
               "sequence_logprobs: logits must be [N, V], got ", describe(logits));
  const std::int64_t n = logits.size(0);
  TROUPE_CHECK(seq > 0 && n % seq == 0, "sequence_logprobs: ", n,
               " rows are not whole sequences of ", seq);
  TROUPE_CHECK(targets.defined() && targets.numel() == n, "sequence_logprobs: targets must have ",
               n, " rows, got ", describe(targets));
  TROUPE_CHECK(losses.defined() && losses.numel() >= n, "sequence_logprobs: losses must have ", n,
               " rows, got ", describe(losses));
  return n / seq;
}

}  // namespace

std::vector<double> sequence_logprobs(const tensor& logits, const tensor& targets, std::int64_t seq,
                                      const tensor& losses, const sequence_logprob_options& opt) {
  const std::int64_t b = sequences(logits, targets, seq, losses);
  std::vector<double> out(static_cast<std::size_t>(b));
  for (std::int64_t i = 0; i < b; ++i) {
    tensor l = losses.narrow(0, 0, seq);
    const std::int64_t count =
        ops::cross_entropy(logits.narrow(0, i * seq, seq), targets.narrow(0, i * seq, seq), l,
                           tensor{}, 0.0, opt.ignore_index);
    const double sum = -ops::sum(l);
    out[static_cast<std::size_t>(i)] =
        opt.average ? (count == 0 ? 0.0 : sum / static_cast<double>(count)) : sum;
  }
  return out;
}

void sequence_logprobs_backward(const tensor& logits, const tensor& targets, std::int64_t seq,
                                std::span<const double> dlogp, const tensor& losses,
                                const tensor& dlogits, const sequence_logprob_options& opt) {
  const std::int64_t b = sequences(logits, targets, seq, losses);
  TROUPE_CHECK(static_cast<std::int64_t>(dlogp.size()) == b, "sequence_logprobs_backward: ", b,
               " sequences but ", dlogp.size(), " gradients");
  TROUPE_CHECK(dlogits.defined() && dlogits.sizes() == logits.sizes(),
               "sequence_logprobs_backward: dlogits must be like the logits ", logits.sizes().str(),
               ", got ", describe(dlogits));
  for (std::int64_t i = 0; i < b; ++i) {
    tensor l = losses.narrow(0, 0, seq);
    tensor lg = logits.narrow(0, i * seq, seq), tg = targets.narrow(0, i * seq, seq);
    double scale = -dlogp[static_cast<std::size_t>(i)];  // d(logp)/dlogits = -(softmax - onehot)
    if (opt.average) {
      const std::int64_t count = ops::cross_entropy(lg, tg, l, tensor{}, 0.0, opt.ignore_index);
      scale = count == 0 ? 0.0 : scale / static_cast<double>(count);
    }
    ops::cross_entropy(lg, tg, l, dlogits.narrow(0, i * seq, seq), scale, opt.ignore_index);
  }
}

}  // namespace troupe::models
