#include "models/sampling.hpp"

#include <algorithm>
#include <cmath>

#include "memory/error.hpp"

namespace troupe::models {

token_sampler::token_sampler(const sampling_options& opt, std::uint64_t seed)
    : opt_(opt), gen_(seed) {
  TROUPE_CHECK(opt.greedy || opt.temperature > 0, "sampling: temperature must be > 0, got ",
               opt.temperature);
  TROUPE_CHECK(opt.top_k >= 0, "sampling: top_k must be >= 0, got ", opt.top_k);
  TROUPE_CHECK(opt.top_p > 0 && opt.top_p <= 1, "sampling: top_p must be in (0, 1], got ",
               opt.top_p);
}

std::int32_t token_sampler::next(std::span<const float> logits) {
  TROUPE_CHECK(!logits.empty(), "sampling: empty logits");
  if (opt_.greedy)
    return static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) -
                                     logits.begin());
  auto& c = scratch_;
  c.resize(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i)
    c[i] = {static_cast<double>(logits[i]) / opt_.temperature, static_cast<std::int32_t>(i)};
  // Candidates sorted by logit, best first (ties by id, so the order is deterministic).
  std::sort(c.begin(), c.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::size_t keep = c.size();
  if (opt_.top_k > 0) keep = std::min<std::size_t>(keep, static_cast<std::size_t>(opt_.top_k));
  const double mx = c[0].first;
  double z = 0;
  for (std::size_t i = 0; i < keep; ++i) z += c[i].first = std::exp(c[i].first - mx);
  if (opt_.top_p < 1.0) {
    // The smallest prefix whose probability reaches top_p (always at least one token).
    double acc = 0;
    std::size_t n = 0;
    while (n < keep) {
      acc += c[n].first / z;
      ++n;
      if (acc >= opt_.top_p) break;
    }
    keep = n;
    z = 0;
    for (std::size_t i = 0; i < keep; ++i) z += c[i].first;
  }
  double u = std::uniform_real_distribution<double>(0.0, z)(gen_);
  for (std::size_t i = 0; i < keep; ++i) {
    u -= c[i].first;
    if (u <= 0) return c[i].second;
  }
  return c[keep - 1].second;
}

}  // namespace troupe::models
