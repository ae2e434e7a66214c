// param_gather: gathering and releasing parameter groups (see param_gather.hpp).
#include "models/parallel/param_gather.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <string>

#include "memory/error.hpp"
#include "models/parallel/data_parallel.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {
namespace {

float* f32_at(const tensor& t, std::int64_t offset) {
  return static_cast<float*>(t.data()) + offset;
}

const char* use_name(block_use u) {
  switch (u) {
    case block_use::before_forward:
      return "before its forward";
    case block_use::after_forward:
      return "after its forward";
    case block_use::before_backward:
      return "before its backward";
    case block_use::after_backward:
      return "after its backward";
  }
  return "?";
}

}  // namespace

param_gather::param_gather(collective::communicator& dp, layer_memory& mem,
                           const std::vector<dp_bucket>& buckets, const tensor& shard,
                           std::vector<group> groups, const options& opts)
    : comm_(dp),
      mem_(mem),
      buckets_(buckets),
      shard_(shard),
      groups_(std::move(groups)),
      opts_(opts),
      outside_(groups_.size()) {
  TROUPE_CHECK(opts.prefetch >= 0, "param_gather: prefetch must be >= 0, got ", opts.prefetch);
  const int n = comm_.size();
  for (std::size_t g = 0; g < groups_.size(); ++g) {
    const auto& gr = groups_[g];
    if (gr.block < 0) {
      TROUPE_CHECK(outside_ == groups_.size(), "param_gather: two groups outside the blocks");
      outside_ = g;
      continue;
    }
    if (static_cast<std::size_t>(gr.block) >= of_block_.size())
      of_block_.resize(static_cast<std::size_t>(gr.block) + 1, groups_.size());
    TROUPE_CHECK(of_block_[static_cast<std::size_t>(gr.block)] == groups_.size(),
                 "param_gather: block ", gr.block, " has two groups");
    of_block_[static_cast<std::size_t>(gr.block)] = g;
  }
  state_.assign(groups_.size(), state::gathered);  // the buffer holds the initial weights
  works_.resize(buckets_.size());
  pad_at_.assign(buckets_.size(), -1);
  std::int64_t pad = 0;
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    if (!buckets_[i].padded(n)) continue;
    pad_at_[i] = pad;
    pad += buckets_[i].chunk * n;
  }
  if (pad > 0) pad_ = zeros({pad}, dtype::f32, device::cpu());
  for (const auto& gr : groups_) gathered_ += gr.elements;
  peak_ = gathered_;
}

std::size_t param_gather::group_of(std::int64_t block) const {
  TROUPE_CHECK(block >= 0 && static_cast<std::size_t>(block) < of_block_.size() &&
                   of_block_[static_cast<std::size_t>(block)] < groups_.size(),
               "param_gather: rank ", comm_.rank(), " of ", comm_.name(), ": the piece used block ",
               block, ", which holds no parameters");
  return of_block_[static_cast<std::size_t>(block)];
}

void param_gather::issue(std::size_t i) {
  const dp_bucket& b = buckets_[i];
  float* out = pad_at_[i] >= 0 ? f32_at(pad_, pad_at_[i]) : f32_at(mem_.params(), b.begin);
  if (opts_.pins == nullptr) {
    works_[i] = comm_.all_gather(f32_at(shard_, b.shard_offset), out, b.chunk, dtype::f32);
    return;
  }
  const float* in = opts_.pins->pin_params(i);
  try {
    works_[i] = comm_.all_gather(in, out, b.chunk, dtype::f32);
  } catch (...) {
    opts_.pins->unpin_params(i);
    throw;
  }
}

void param_gather::wait_bucket(std::size_t i) {
  if (opts_.pins == nullptr) {
    works_[i].wait();
  } else {
    if (!works_[i].valid()) return;  // a failed wait unpinned it already
    try {
      works_[i].wait();
    } catch (...) {
      works_[i] = {};
      opts_.pins->unpin_params(i);
      throw;
    }
    opts_.pins->unpin_params(i);
  }
  works_[i] = {};
  const dp_bucket& b = buckets_[i];
  if (pad_at_[i] >= 0)  // the staged bucket, without its padding
    std::memcpy(f32_at(mem_.params(), b.begin), f32_at(pad_, pad_at_[i]),
                static_cast<std::size_t>(b.length) * 4);
}

void param_gather::gather(std::size_t g) {
  if (state_[g] != state::released) return;
  for (std::size_t i : groups_[g].buckets) issue(i);
  state_[g] = state::gathering;
  gathered_ += groups_[g].elements;
  peak_ = std::max(peak_, gathered_);
}

void param_gather::wait(std::size_t g) {
  if (state_[g] != state::gathering) return;
  auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i : groups_[g].buckets) wait_bucket(i);
  wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  state_[g] = state::gathered;
}

void param_gather::release(std::size_t g) {
  wait(g);  // a gather in flight still writes into the range
  if (state_[g] != state::gathered) return;
  const tensor& p = mem_.params();
  for (const auto& [begin, length] : groups_[g].ranges) {
    if (opts_.poison)
      ops::fill(p.narrow(0, begin, length), std::numeric_limits<double>::quiet_NaN());
    else
      mem_.release_params(begin, length);
  }
  state_[g] = state::released;
  gathered_ -= groups_[g].elements;
}

void param_gather::release_all() {
  for (std::size_t g = 0; g < groups_.size(); ++g) release(g);
}

void param_gather::abandon() noexcept {
  for (std::size_t i = 0; i < works_.size(); ++i) {
    if (!works_[i].valid()) continue;
    try {
      works_[i].wait();
    } catch (...) {
    }
    works_[i] = {};
    if (opts_.pins == nullptr) continue;
    try {
      opts_.pins->unpin_params(i);
    } catch (...) {
    }
  }
  for (auto& s : state_)
    if (s == state::gathering) s = state::gathered;
}

void param_gather::gather_all() {
  // In forward order: the buckets from the start of the buffer first (they are listed from the
  // end), whatever was gathered before gathered again.
  for (std::size_t g = 0; g < groups_.size(); ++g) wait(g);
  if (opts_.pins != nullptr) {  // one bucket pinned at a time
    auto t0 = std::chrono::steady_clock::now();
    for (auto i = buckets_.size(); i-- > 0;) {
      issue(i);
      wait_bucket(i);
    }
    wait_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::fill(state_.begin(), state_.end(), state::gathered);
  } else {
    for (auto i = buckets_.size(); i-- > 0;) issue(i);
    std::fill(state_.begin(), state_.end(), state::gathering);
    for (auto g = groups_.size(); g-- > 0;) wait(g);
  }
  gathered_ = 0;
  for (const auto& gr : groups_) gathered_ += gr.elements;
  peak_ = std::max(peak_, gathered_);
}

void param_gather::begin_step(int microbatches, bool with_hook) {
  release_all();  // whatever gather_all left
  gathered_ = 0;
  peak_ = 0;
  peak_resident_ = 0;
  if (!with_hook) {
    gather_all();
    sample_resident();
    return;
  }
  // The order the piece uses its blocks: per microbatch forward ascending, backward descending.
  schedule_.clear();
  std::vector<std::int64_t> blocks;
  for (const auto& gr : groups_)
    if (gr.block >= 0) blocks.push_back(gr.block);
  std::sort(blocks.begin(), blocks.end());
  for (int k = 0; k < microbatches; ++k) {
    schedule_.insert(schedule_.end(), blocks.begin(), blocks.end());
    schedule_.insert(schedule_.end(), blocks.rbegin(), blocks.rend());
  }
  cursor_ = 0;
  stepping_ = true;
  if (outside_ < groups_.size()) gather(outside_);
  // A paged shard (opts.pins): the outside group's pins go before the blocks' are taken, so the
  // host pool holds the larger of the two, not their sum.
  if (opts_.pins != nullptr && outside_ < groups_.size()) wait(outside_);
  for (std::size_t j = 0; j < schedule_.size() && j <= static_cast<std::size_t>(opts_.prefetch);
       ++j)
    gather(group_of(schedule_[j]));
  if (outside_ < groups_.size()) wait(outside_);
}

bool param_gather::used_within(std::int64_t block, std::size_t from, std::size_t count) const {
  for (std::size_t j = from; j < schedule_.size() && j < from + count; ++j)
    if (schedule_[j] == block) return true;
  return false;
}

void param_gather::on_use(std::int64_t block, block_use use) {
  if (!stepping_) return;
  TROUPE_CHECK(cursor_ < schedule_.size() && schedule_[cursor_] == block, "param_gather: rank ",
               comm_.rank(), " of ", comm_.name(), ": the piece used block ", block, " (",
               use_name(use), ") where ZeRO 3 expected ",
               cursor_ < schedule_.size() ? "block " + std::to_string(schedule_[cursor_])
                                          : std::string("no more blocks"),
               " (each microbatch: forward of the blocks ascending, backward descending)");
  const auto depth = static_cast<std::size_t>(opts_.prefetch);
  const std::size_t g = group_of(block);
  if (use == block_use::before_forward || use == block_use::before_backward) {
    // Prefetch first, so the next blocks' gathers run while this one is waited and computed.
    for (std::size_t j = cursor_ + 1; j < schedule_.size() && j <= cursor_ + depth; ++j)
      gather(group_of(schedule_[j]));
    gather(g);
    wait(g);
    sample_resident();
    return;
  }
  sample_resident();  // prefetched gathers may have landed meanwhile
  ++cursor_;
  if (!used_within(block, cursor_, depth + 1)) release(g);
}

void param_gather::end_step() {
  stepping_ = false;
  release_all();
}

void param_gather::sample_resident() {
  if (opts_.measure_resident)
    peak_resident_ = std::max(peak_resident_, mem_.resident_param_bytes());
}

double param_gather::take_wait_seconds() {
  double w = wait_;
  wait_ = 0;
  return w;
}

}  // namespace troupe::models::parallel
