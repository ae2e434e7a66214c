// plan_samples: post-training sample sources for the parallel engine (plan_samples.hpp).
#include "models/post/plan_samples.hpp"

#include <algorithm>
#include <span>
#include <utility>

#include "memory/error.hpp"
#include "models/post/grpo_loss.hpp"
#include "models/post/ppo_loss.hpp"
#include "models/post/sequence_logprob.hpp"

namespace troupe::models {
namespace {

// Host rows [rows, seq] of the samples [begin, end), sample i being row i mod n of `src`.
void copy_rows(const std::vector<std::int32_t>& src, std::int64_t n, std::int64_t seq,
               std::int64_t begin, std::int64_t end, std::vector<std::int32_t>& dst) {
  dst.resize(static_cast<std::size_t>((end - begin) * seq));
  for (std::int64_t i = begin; i < end; ++i)
    std::copy_n(src.begin() + static_cast<std::ptrdiff_t>((i % n) * seq), seq,
                dst.begin() + static_cast<std::ptrdiff_t>((i - begin) * seq));
}

tensor rows_view(std::vector<std::int32_t>& v, std::int64_t seq) {
  const auto rows = static_cast<std::int64_t>(v.size()) / seq;
  return tensor(v.data(), v.size() * sizeof(std::int32_t), dtype::i32, {rows, seq});
}

std::int64_t trained(const std::vector<std::int32_t>& targets, std::int64_t from, std::int64_t n) {
  return std::count_if(targets.begin() + static_cast<std::ptrdiff_t>(from),
                       targets.begin() + static_cast<std::ptrdiff_t>(from + n),
                       [](std::int32_t t) { return t != -100; });
}

}  // namespace

parallel::sample_source sft_samples(std::shared_ptr<const sft_rows> rows, std::int64_t batch,
                                    std::int64_t grad_accum, bool packed) {
  TROUPE_CHECK(rows != nullptr && rows->rows() > 0, "sft: no rows to train on");
  TROUPE_CHECK(batch > 0 && grad_accum > 0, "sft: batch ", batch, " and grad_accum ", grad_accum,
               " must be > 0");
  struct buffers {
    std::vector<std::int32_t> ids, targets, segments, positions;
  };
  auto buf = std::make_shared<buffers>();
  return [rows, batch, grad_accum, packed, buf](const parallel::sample_request& r) {
    const sft_rows& s = *rows;
    const std::int64_t n = s.rows(), t = s.seq, g = batch * grad_accum;
    // The step's assistant targets: the weight is this microbatch's share of them, so the step's
    // loss is their mean (sft_micro_batch's grad_accum * count_k / total, over the trainer's
    // 1 / grad_accum).
    std::int64_t total = 0, mine = 0;
    for (std::int64_t i = r.step * g; i < (r.step + 1) * g; ++i) {
      const std::int64_t c = trained(s.targets, (i % n) * t, t);
      total += c;
      if (i >= r.begin && i < r.end) mine += c;
    }
    auto& b = *buf;
    copy_rows(s.ids, n, t, r.begin, r.end, b.ids);
    copy_rows(s.targets, n, t, r.begin, r.end, b.targets);
    parallel::microbatch_data mb;
    mb.ids = rows_view(b.ids, t);
    mb.targets = rows_view(b.targets, t);
    mb.weight = total == 0 ? r.weight : static_cast<double>(mine) / static_cast<double>(total);
    if (packed) {
      copy_rows(s.segments, n, t, r.begin, r.end, b.segments);
      copy_rows(s.positions, n, t, r.begin, r.end, b.positions);
      mb.segments = rows_view(b.segments, t);
      mb.positions = rows_view(b.positions, t);
    }
    return mb;
  };
}

std::vector<double> dpo_reference_logprobs(causal_lm& reference, const preference_rows& rows,
                                           const dpo_options& opt) {
  const std::int64_t t = rows.seq;
  std::vector<double> out;
  std::vector<std::int32_t> ids, targets;
  for (std::int64_t p = 0; p < rows.pairs(); ++p) {
    copy_rows(rows.ids, 2 * rows.pairs(), t, 2 * p, 2 * p + 2, ids);
    copy_rows(rows.targets, 2 * rows.pairs(), t, 2 * p, 2 * p + 2, targets);
    const tensor tg = rows_view(targets, t);
    reference.forward(rows_view(ids, t), tg);
    const tensor logits = reference.logits();
    owned_tensor scratch = empty({logits.size(0)}, logits.type(), logits.dev());
    const auto lp = sequence_logprobs(logits, tg.reshape({2 * t}), t, scratch,
                                      {.average = opt.type == dpo_loss_type::ipo});
    out.insert(out.end(), lp.begin(), lp.end());
  }
  return out;
}

parallel::sample_source dpo_samples(std::shared_ptr<const preference_rows> rows,
                                    std::shared_ptr<const std::vector<double>> reference,
                                    const dpo_options& opt) {
  TROUPE_CHECK(rows != nullptr && rows->pairs() > 0, "dpo: no pairs to train on");
  TROUPE_CHECK(
      reference != nullptr && static_cast<std::int64_t>(reference->size()) == 2 * rows->pairs(),
      "dpo: ", 2 * rows->pairs(), " reference log-probabilities needed, got ",
      reference == nullptr ? 0 : reference->size());
  struct buffers {
    std::vector<std::int32_t> ids, targets;
  };
  auto buf = std::make_shared<buffers>();
  return [rows, reference, opt, buf](const parallel::sample_request& r) {
    TROUPE_CHECK(r.begin % 2 == 0 && r.end % 2 == 0, "dpo: a microbatch must hold whole pairs ",
                 "(an even number of rows per data-parallel rank and microbatch: 2 x train.batch ",
                 "divided by parallel.dp x parallel.microbatches), got samples ", r.begin, "..",
                 r.end);
    const preference_rows& s = *rows;
    const std::int64_t n = 2 * s.pairs(), t = s.seq, pairs = (r.end - r.begin) / 2;
    auto& b = *buf;
    copy_rows(s.ids, n, t, r.begin, r.end, b.ids);
    copy_rows(s.targets, n, t, r.begin, r.end, b.targets);
    std::vector<double> ref_c, ref_r;
    std::vector<std::int64_t> counts;
    for (std::int64_t i = r.begin; i < r.end; ++i) {
      ((i % 2 == 0) ? ref_c : ref_r).push_back((*reference)[static_cast<std::size_t>(i % n)]);
      counts.push_back(trained(b.targets, (i - r.begin) * t, t));
    }
    parallel::microbatch_data mb;
    mb.ids = rows_view(b.ids, t);
    mb.targets = rows_view(b.targets, t);
    mb.weight = r.weight;
    const bool average = opt.type == dpo_loss_type::ipo;
    mb.objective = [opt, pairs, t, average, ref_c = std::move(ref_c), ref_r = std::move(ref_r),
                    counts = std::move(counts)](std::span<const double> logp) {
      // Row b's response log-probability (its sum, or mean for IPO) -> dpo_loss -> d loss / d
      // logp of each of its tokens (the same for all of them, / count for IPO).
      std::vector<double> seq(static_cast<std::size_t>(2 * pairs), 0.0);
      for (std::int64_t b = 0; b < 2 * pairs; ++b) {
        for (std::int64_t i = 0; i < t; ++i)
          seq[static_cast<std::size_t>(b)] += logp[static_cast<std::size_t>(b * t + i)];
        const auto c = static_cast<double>(counts[static_cast<std::size_t>(b)]);
        if (average)
          seq[static_cast<std::size_t>(b)] = c == 0 ? 0.0 : seq[static_cast<std::size_t>(b)] / c;
      }
      std::vector<double> chosen, rejected;
      for (std::int64_t b = 0; b < 2 * pairs; ++b)
        (b % 2 == 0 ? chosen : rejected).push_back(seq[static_cast<std::size_t>(b)]);
      const dpo_result d = dpo_loss(chosen, rejected, ref_c, ref_r, opt);
      token_loss out{d.loss, std::vector<double>(logp.size(), 0.0)};
      for (std::int64_t b = 0; b < 2 * pairs; ++b) {
        const auto p = static_cast<std::size_t>(b / 2);
        double g = b % 2 == 0 ? d.d_chosen[p] : d.d_rejected[p];
        const auto c = static_cast<double>(counts[static_cast<std::size_t>(b)]);
        if (average) g = c == 0 ? 0.0 : g / c;
        // Ignored positions have logp 0 and no gradient: the head writes 0 there anyway.
        for (std::int64_t i = 0; i < t; ++i) out.dlogp[static_cast<std::size_t>(b * t + i)] = g;
      }
      return out;
    };
    return mb;
  };
}

parallel::sample_source grpo_samples(std::shared_ptr<const grpo_batch> batch,
                                     const grpo_options& opt,
                                     std::function<void(const grpo_microbatch_result&)> on_result) {
  TROUPE_CHECK(batch != nullptr && batch->rows > 0, "grpo: no rows to train on");
  struct buffers {
    std::vector<std::int32_t> ids, targets;
  };
  auto buf = std::make_shared<buffers>();
  return [batch, opt, buf, on_result](const parallel::sample_request& r) {
    const grpo_batch& s = *batch;
    const std::int64_t n = s.rows, t = s.seq;
    auto& b = *buf;
    copy_rows(s.ids, n, t, r.begin, r.end, b.ids);
    copy_rows(s.targets, n, t, r.begin, r.end, b.targets);
    std::vector<double> old, ref, adv;
    for (std::int64_t i = r.begin; i < r.end; ++i) {
      const auto from = static_cast<std::ptrdiff_t>((i % n) * t);
      old.insert(old.end(), s.old_logp.begin() + from, s.old_logp.begin() + from + t);
      if (!s.ref_logp.empty())
        ref.insert(ref.end(), s.ref_logp.begin() + from, s.ref_logp.begin() + from + t);
      adv.push_back(s.advantages[static_cast<std::size_t>(i % n)]);
    }
    parallel::microbatch_data mb;
    mb.ids = rows_view(b.ids, t);
    mb.targets = rows_view(b.targets, t);
    mb.weight = r.weight;
    mb.objective = [opt, old = std::move(old), ref = std::move(ref), adv = std::move(adv),
                    mask = completion_mask(b.targets), on_result, begin = r.begin,
                    weight = r.weight](std::span<const double> logp) {
      grpo_result g = grpo_loss(logp, old, ref, mask, adv, opt);
      if (on_result) {
        grpo_microbatch_result seen{.begin = begin, .weight = weight, .result = {}, .masked = 0};
        seen.result.loss = g.loss;
        seen.result.kl = g.kl;
        seen.result.clip_ratio = g.clip_ratio;
        seen.masked = std::count(mask.begin(), mask.end(), std::uint8_t{1});
        on_result(seen);
      }
      return token_loss{g.loss, std::move(g.dlogp)};
    };
    return mb;
  };
}

parallel::sample_source ppo_samples(std::shared_ptr<const ppo_batch> batch, const ppo_options& opt,
                                    std::function<void(const ppo_microbatch_result&)> on_result) {
  TROUPE_CHECK(batch != nullptr, "ppo: no rows to train on");
  struct buffers {
    std::vector<std::int32_t> ids, targets;
  };
  auto buf = std::make_shared<buffers>();
  return [batch, opt, buf, on_result](const parallel::sample_request& r) {
    const ppo_batch& s = *batch;
    const std::int64_t n = s.rows, t = s.seq;
    TROUPE_CHECK(n > 0 && s.old_logp.size() == static_cast<std::size_t>(n * t) &&
                     s.advantages.size() == static_cast<std::size_t>(n * t),
                 "ppo: a batch of ", n, " x ", t, " rows with ", s.old_logp.size(),
                 " old log-probabilities and ", s.advantages.size(), " advantages");
    const std::int64_t total = trained(s.targets, 0, n * t);  // the batch's completion tokens
    auto& b = *buf;
    copy_rows(s.ids, n, t, r.begin, r.end, b.ids);
    copy_rows(s.targets, n, t, r.begin, r.end, b.targets);
    std::vector<double> old, adv;
    for (std::int64_t i = r.begin; i < r.end; ++i) {
      const auto from = static_cast<std::ptrdiff_t>((i % n) * t);
      old.insert(old.end(), s.old_logp.begin() + from, s.old_logp.begin() + from + t);
      adv.insert(adv.end(), s.advantages.begin() + from, s.advantages.begin() + from + t);
    }
    const std::int64_t mine = trained(b.targets, 0, static_cast<std::int64_t>(b.targets.size()));
    parallel::microbatch_data mb;
    mb.ids = rows_view(b.ids, t);
    mb.targets = rows_view(b.targets, t);
    mb.weight = total == 0 ? r.weight : static_cast<double>(mine) / static_cast<double>(total);
    mb.objective = [opt, old = std::move(old), adv = std::move(adv),
                    mask = completion_mask(b.targets), on_result, begin = r.begin,
                    weight = mb.weight](std::span<const double> logp) {
      ppo_policy_result p = ppo_policy_loss(logp, old, adv, mask, opt.cliprange);
      token_loss out{p.loss, std::move(p.dlogp)};
      if (!on_result) return out;
      // The result once the head has the entropies: their mean over the completion tokens, as
      // the single process's mean_token_entropy (models/post/ppo_loss.hpp).
      const ppo_microbatch_result seen{.begin = begin,
                                       .weight = weight,
                                       .loss = p.loss,
                                       .clipfrac = p.clipfrac,
                                       .approx_kl = p.approx_kl};
      out.on_entropy = [on_result, seen, mask](std::span<const double> h) {
        TROUPE_CHECK(h.size() == mask.size(), "ppo: ", h.size(), " entropies for ", mask.size(),
                     " positions");
        ppo_microbatch_result r = seen;
        double sum = 0;
        std::size_t count = 0;
        for (std::size_t i = 0; i < h.size(); ++i)
          if (mask[i] != 0) {
            sum += h[i];
            ++count;
          }
        r.entropy = count == 0 ? 0.0 : sum / static_cast<double>(count);
        on_result(r);
      };
      return out;
    };
    return mb;
  };
}

}  // namespace troupe::models
