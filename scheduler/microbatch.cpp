// microbatch_plan: slot sizes and sample ranges (see microbatch.hpp).
#include "scheduler/microbatch.hpp"

#include <stdexcept>
#include <string>

namespace troupe::scheduler {

microbatch_plan::microbatch_plan(std::int64_t global_batch, int dp, int microbatches)
    : global_batch_(global_batch), dp_(dp), microbatches_(microbatches) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("microbatch_plan: " + what);
  };
  if (dp < 1) fail("dp = " + std::to_string(dp) + " must be >= 1");
  if (microbatches < 1) fail("microbatches = " + std::to_string(microbatches) + " must be >= 1");
  if (global_batch < static_cast<std::int64_t>(dp) * microbatches)
    fail("global batch " + std::to_string(global_batch) +
         " is smaller than dp x microbatches = " + std::to_string(dp) + " x " +
         std::to_string(microbatches) + ": every microbatch needs a sample");
}

void microbatch_plan::check(int dp_rank, int microbatch) const {
  if (dp_rank < 0 || dp_rank >= dp_ || microbatch < 0 || microbatch >= microbatches_)
    throw std::out_of_range("microbatch_plan: (dp rank " + std::to_string(dp_rank) +
                            ", microbatch " + std::to_string(microbatch) + ") outside dp " +
                            std::to_string(dp_) + " x microbatches " +
                            std::to_string(microbatches_));
}

std::int64_t microbatch_plan::size(int dp_rank, int microbatch) const {
  check(dp_rank, microbatch);
  const std::int64_t q = slot(dp_rank, microbatch);
  return global_batch_ / slots() + (q < global_batch_ % slots() ? 1 : 0);
}

sample_range microbatch_plan::range(int dp_rank, int microbatch, std::int64_t step) const {
  check(dp_rank, microbatch);
  const std::int64_t q = slot(dp_rank, microbatch), base = global_batch_ / slots(),
                     extra = global_batch_ % slots();
  // Slots before q: q * base samples, plus one for each of them among the first `extra`.
  const std::int64_t begin = step * global_batch_ + q * base + (q < extra ? q : extra);
  return {begin, begin + size(dp_rank, microbatch)};
}

std::vector<std::int64_t> microbatch_plan::sizes(int dp_rank) const {
  std::vector<std::int64_t> out;
  for (int k = 0; k < microbatches_; ++k) out.push_back(size(dp_rank, k));
  return out;
}

std::int64_t microbatch_plan::rank_samples(int dp_rank) const {
  std::int64_t n = 0;
  for (auto s : sizes(dp_rank)) n += s;
  return n;
}

double microbatch_plan::weight(int dp_rank, int microbatch) const {
  return static_cast<double>(size(dp_rank, microbatch)) / static_cast<double>(global_batch_);
}

}  // namespace troupe::scheduler
