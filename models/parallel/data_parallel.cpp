// dp_trainer: the data-parallel step (see data_parallel.hpp).
#include "models/parallel/data_parallel.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "memory/error.hpp"
#include "models/parallel/model_producer.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {
namespace {

using clock_type = std::chrono::steady_clock;
using range_list = std::vector<std::pair<std::int64_t, std::int64_t>>;  // [begin, length)

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

float* f32_at(const tensor& t, std::int64_t offset) {
  return static_cast<float*>(t.data()) + offset;
}

// This rank's part of bucket b: [begin, end) of the flat buffer (may be empty).
std::pair<std::int64_t, std::int64_t> own_range(const dp_bucket& b, int rank) {
  std::int64_t begin = std::min(b.begin + rank * b.chunk, b.begin + b.length);
  std::int64_t end = std::min(begin + b.chunk, b.begin + b.length);
  return {begin, end};
}

// Where parameter slot s starts in the flat parameter buffer p (checked).
std::int64_t flat_offset(const tensor_slot& s, const tensor& p) {
  const auto elem = static_cast<std::ptrdiff_t>(p.element_size());
  std::int64_t off =
      (static_cast<const char*>(s.field->data()) - static_cast<const char*>(p.data())) / elem;
  TROUPE_CHECK(off >= 0 && off + s.field->numel() <= p.numel(), "dp_trainer: parameter '", s.name,
               "' does not live in the flat parameter buffer");
  return off;
}

// Which elements of the flat parameter buffer are exempt from weight decay.
std::vector<bool> exempt_mask(const slot_list& slots, const tensor& p, bool decay_exempt) {
  std::vector<bool> exempt(static_cast<std::size_t>(p.numel()), false);
  if (!decay_exempt) return exempt;
  for (const auto& s : slots.slots()) {
    if (s.kind != slot_kind::param || !biases_norms_embeddings(s)) continue;
    std::fill_n(exempt.begin() + flat_offset(s, p), s.field->numel(), true);
  }
  return exempt;
}

// Sorted, merged ranges.
// `ranges` (sorted, disjoint) cut so that each of `cuts` (sorted, disjoint, each inside one range)
// is a range of its own.
range_list cut_at(const range_list& ranges, const range_list& cuts) {
  if (cuts.empty()) return ranges;
  range_list out;
  std::size_t k = 0;
  for (const auto& [begin, length] : ranges) {
    std::int64_t at = begin;
    const std::int64_t end = begin + length;
    for (; k < cuts.size() && cuts[k].first + cuts[k].second <= end; ++k) {
      const auto [b, n] = cuts[k];
      if (b < at) continue;
      if (b > at) out.emplace_back(at, b - at);
      out.emplace_back(b, n);
      at = b + n;
    }
    if (at < end) out.emplace_back(at, end - at);
  }
  return out;
}

range_list merged(range_list r) {
  std::sort(r.begin(), r.end());
  range_list out;
  for (const auto& [b, n] : r) {
    if (n <= 0) continue;
    if (!out.empty() && out.back().first + out.back().second >= b)
      out.back().second = std::max(out.back().second, b + n - out.back().first);
    else
      out.emplace_back(b, n);
  }
  return out;
}

}  // namespace

dp_options dp_options::of(const scheduler::parallel_plan& plan) {
  dp_options o;
  o.bucket_bytes = static_cast<std::size_t>(plan.dp_bucket_bytes);
  o.overlap = plan.dp_overlap;
  return o;
}

std::vector<dp_bucket> make_buckets(std::int64_t n, int dp, std::int64_t bucket_elems) {
  TROUPE_CHECK(dp >= 1 && n >= 0, "make_buckets: dp ", dp, ", n ", n);
  const std::int64_t chunk = (std::max<std::int64_t>(bucket_elems, dp) + dp - 1) / dp;
  std::vector<dp_bucket> out;
  std::int64_t shard = 0;
  for (std::int64_t end = n; end > 0;) {
    dp_bucket b;
    b.length = std::min(chunk * dp, end);
    b.begin = end - b.length;
    b.chunk = (b.length + dp - 1) / dp;
    b.shard_offset = shard;
    shard += b.chunk;
    out.push_back(b);
    end = b.begin;
  }
  return out;
}

std::vector<dp_bucket> make_buckets(const range_list& ranges, int dp, std::int64_t bucket_elems) {
  std::vector<dp_bucket> out;
  std::int64_t end = -1;
  for (auto r = ranges.rbegin(); r != ranges.rend(); ++r) {
    const auto [begin, length] = *r;
    TROUPE_CHECK(length >= 0 && (end < 0 || begin + length == end), "make_buckets: range [", begin,
                 ", +", length, ") does not end where the next one begins (", end, ")");
    end = begin;
    for (dp_bucket b : make_buckets(length, dp, bucket_elems)) {
      b.begin += begin;
      const std::int64_t rest = b.length % dp;
      if (b.padded(dp) && b.length > dp) {  // the unpadded part, then the short tail
        out.push_back({b.begin + rest, b.length - rest, (b.length - rest) / dp});
        b.length = rest;
        b.chunk = 1;
      }
      out.push_back(b);
    }
  }
  std::int64_t shard = 0;
  for (auto& b : out) {
    b.shard_offset = shard;
    shard += b.chunk;
  }
  return out;
}

namespace {

// The groups of the flat parameter buffer p (param_gather.hpp): the parameters in order of their
// offsets, one group per block and one for the rest, each range running to the next one's start.
std::vector<param_gather::group> make_groups(const slot_list& slots, const tensor& p) {
  std::vector<std::pair<std::int64_t, std::int64_t>> starts;  // offset, block
  for (const auto& s : slots.slots())
    if (s.kind == slot_kind::param) starts.emplace_back(flat_offset(s, p), s.block);
  std::sort(starts.begin(), starts.end());
  std::vector<param_gather::group> groups;
  auto group_for = [&](std::int64_t block) -> param_gather::group& {
    for (auto& g : groups)
      if (g.block == block) return g;
    groups.push_back({block, {}, {}, 0});
    return groups.back();
  };
  for (std::size_t i = 0; i < starts.size();) {
    std::size_t j = i;
    while (j < starts.size() && starts[j].second == starts[i].second) ++j;
    std::int64_t begin = i == 0 ? 0 : starts[i].first;
    std::int64_t end = j == starts.size() ? p.numel() : starts[j].first;
    auto& g = group_for(starts[i].second);
    g.ranges.emplace_back(begin, end - begin);
    g.elements += end - begin;
    i = j;
  }
  if (starts.empty() && p.numel() > 0) groups.push_back({-1, {{0, p.numel()}}, {}, p.numel()});
  return groups;
}

// The bucket ranges: the blocks' group ranges as they are; the group outside the blocks cut at its
// parameters (each one's [offset, numel) on its own, the padding between them apart), so that a
// parameter's buckets are cut the same way wherever it lies in the buffer. A tied embedding held
// by two pipeline stages then has its elements summed in the same order on both (a ring
// reduce-scatter's order depends on which rank owns the chunk), and the two copies stay equal.
range_list bucket_ranges(const std::vector<param_gather::group>& groups, const slot_list& slots,
                         const tensor& p) {
  range_list outside;
  for (const auto& s : slots.slots())
    if (s.kind == slot_kind::param && s.block < 0 && s.field->numel() > 0)
      outside.emplace_back(flat_offset(s, p), s.field->numel());
  std::sort(outside.begin(), outside.end());
  range_list out;
  for (const auto& g : groups) {
    if (g.block >= 0) {
      out.insert(out.end(), g.ranges.begin(), g.ranges.end());
      continue;
    }
    for (const auto& [begin, length] : g.ranges) {
      std::int64_t at = begin;
      const std::int64_t end = begin + length;
      for (const auto& [b, n] : outside) {
        if (b < at || b + n > end) continue;
        if (b > at) out.emplace_back(at, b - at);
        out.emplace_back(b, n);
        at = b + n;
      }
      if (at < end) out.emplace_back(at, end - at);
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

// AdamW over the chunks this rank owns: moments only for them, cut into runs of equal decay.
struct dp_trainer::shard_optimizer {
  struct piece {
    std::int64_t param = 0, length = 0;  // in the parameter tensor step() is given
    std::int64_t grad = 0;               // in the gradient tensor step() is given
    std::int64_t state = 0;              // in m and v
    bool decay = true;
    std::int64_t flat = 0;  // in the piece's flat buffer
  };
  ops::adamw_options opt;
  std::vector<piece> pieces;
  owned_tensor m, v;  // in memory; paged, optimizer_state()'s copy while one is taken
  std::unique_ptr<paged_moments> paged;
  std::unique_ptr<paged_shard> shard;  // zero 3: the moments with the parameters and gradients
  std::int64_t steps = 0;
  std::int64_t elements = 0;

  // grad_in_shard: the gradients come as the shard buffer (zero 2, 3), else as the flat buffer;
  // param_in_shard: the same for the parameters (zero 3).
  shard_optimizer(const std::vector<dp_bucket>& buckets, int rank, const std::vector<bool>& exempt,
                  bool grad_in_shard, bool param_in_shard, const ops::adamw_options& o)
      : opt(o) {
    std::int64_t state = 0;
    for (const auto& b : buckets) {
      auto [begin, end] = own_range(b, rank);
      for (std::int64_t i = begin; i < end;) {
        std::int64_t j = i;
        while (j < end && exempt[j] == exempt[i]) ++j;
        std::int64_t in_shard = b.shard_offset + (i - begin);
        pieces.push_back({param_in_shard ? in_shard : i, j - i, grad_in_shard ? in_shard : i, state,
                          !exempt[i], i});
        state += j - i;
        i = j;
      }
    }
    elements = state;
  }
  void keep_in_memory() {
    m = zeros({std::max<std::int64_t>(elements, 1)}, dtype::f32, device::cpu());
    v = zeros({std::max<std::int64_t>(elements, 1)}, dtype::f32, device::cpu());
  }
  void keep_in_tiers(const moment_tiers& t) {
    paged = std::make_unique<paged_moments>(elements, t);
  }
  void keep_in_shard_tiers(const std::vector<dp_bucket>& buckets, const moment_tiers& t) {
    shard = std::make_unique<paged_shard>(buckets, t);
  }
  // Paged: a copy of the moments in m and v (optimizer_state), written back before an update.
  void take_copy() {
    if (m.defined()) return;
    if (paged) {
      keep_in_memory();
      paged->copy_out(m, v);
    } else if (shard) {  // from shard coordinates (the pieces' `param`) to the state's
      keep_in_memory();
      copy_shard(false);
    }
  }
  void put_back_copy() {
    if (!m.defined()) return;
    if (paged)
      paged->copy_in(m, v);
    else if (shard)
      copy_shard(true);
    else
      return;
    m = owned_tensor();
    v = owned_tensor();
  }
  // Between m, v (state coordinates) and the paged shard's moments (off the schedule).
  void copy_shard(bool to_shard) {
    std::size_t k = 0;
    shard->for_each(
        {paged_shard::moment_m, paged_shard::moment_v},
        [&](std::int64_t first, const tensor(&views)[4]) {
          const std::int64_t last = first + views[paged_shard::moment_m].numel();
          for (std::size_t i = k; i < pieces.size() && pieces[i].param < last; ++i) {
            const auto& p = pieces[i];
            const std::int64_t lo = std::max(p.param, first);
            const std::int64_t n = std::min(p.param + p.length, last) - lo;
            if (n <= 0) continue;
            const std::int64_t st = p.state + (lo - p.param);
            for (int j : {paged_shard::moment_m, paged_shard::moment_v}) {
              float* seg = views[j].data_as<float>() + (lo - first);
              float* mine = (j == paged_shard::moment_m ? m : v).data_as<float>() + st;
              if (to_shard)
                std::memcpy(seg, mine, static_cast<std::size_t>(n) * 4);
              else
                std::memcpy(mine, seg, static_cast<std::size_t>(n) * 4);
            }
          }
          while (k < pieces.size() && pieces[k].param + pieces[k].length <= last) ++k;
        },
        to_shard);
    shard->rewind();
  }

  // The paged shard's update: segment by segment, the gradients scaled by `clip` (elementwise, as
  // the in-memory path scales the whole shard) and AdamW over the pieces' runs in the segment.
  void step_paged(double lr, double clip) {
    ++steps;
    ops::adamw_options o = opt;
    o.lr = lr;
    o.step = steps;
    std::size_t k = 0;  // the first piece not done
    shard->for_each(
        {paged_shard::params, paged_shard::grads, paged_shard::moment_m, paged_shard::moment_v},
        [&](std::int64_t first, const tensor(&views)[4]) {
          const tensor &ps = views[paged_shard::params], &gs = views[paged_shard::grads],
                       &ms = views[paged_shard::moment_m], &vs = views[paged_shard::moment_v];
          const std::int64_t last = first + ps.numel();
          if (clip != 1.0) ops::scale(gs, clip);
          for (std::size_t i = k; i < pieces.size() && pieces[i].param < last; ++i) {
            const auto& p = pieces[i];
            const std::int64_t lo = std::max(p.param, first);
            const std::int64_t n = std::min(p.param + p.length, last) - lo;
            if (n <= 0) continue;
            o.weight_decay = p.decay ? opt.weight_decay : 0.0;
            ops::adamw(ps.narrow(0, lo - first, n), gs.narrow(0, lo - first, n),
                       ms.narrow(0, lo - first, n), vs.narrow(0, lo - first, n), o);
          }
          while (k < pieces.size() && pieces[k].param + pieces[k].length <= last) ++k;
        },
        true);
  }

  void step(const tensor& params, const tensor& grads, double lr) {
    ++steps;
    ops::adamw_options o = opt;
    o.lr = lr;
    o.step = steps;
    if (!paged) {
      for (const auto& p : pieces) {
        o.weight_decay = p.decay ? opt.weight_decay : 0.0;
        ops::adamw(params.narrow(0, p.param, p.length), grads.narrow(0, p.grad, p.length),
                   m.narrow(0, p.state, p.length), v.narrow(0, p.state, p.length), o);
      }
      return;
    }
    // Segment by segment (the pieces ascend in the state): the runs of the pieces that meet each.
    put_back_copy();
    std::size_t k = 0;  // the first piece not done
    paged->for_each(
        [&](std::int64_t first, const tensor& ms, const tensor& vs) {
          const std::int64_t last = first + ms.numel();
          for (std::size_t i = k; i < pieces.size() && pieces[i].state < last; ++i) {
            const auto& p = pieces[i];
            const std::int64_t lo = std::max(p.state, first);
            const std::int64_t n = std::min(p.state + p.length, last) - lo;
            if (n <= 0) continue;
            const std::int64_t d = lo - p.state;
            o.weight_decay = p.decay ? opt.weight_decay : 0.0;
            ops::adamw(params.narrow(0, p.param + d, n), grads.narrow(0, p.grad + d, n),
                       ms.narrow(0, lo - first, n), vs.narrow(0, lo - first, n), o);
          }
          while (k < pieces.size() && pieces[k].state + pieces[k].length <= last) ++k;
        },
        true);
  }
};

std::int64_t dp_trainer::microbatch_rows(const train_config& cfg) {
  scheduler::microbatch_plan plan(cfg.batch * cfg.grad_accum, cfg.plan.dp, cfg.plan.microbatches);
  std::int64_t most = 0;
  for (int r = 0; r < cfg.plan.dp; ++r)
    for (auto s : plan.sizes(r)) most = std::max(most, s);
  return most;
}

dp_trainer::dp_trainer(causal_lm& model, const train_config& cfg, collective::communicator& comm,
                       const dp_options& opts)
    : dp_trainer(std::make_unique<model_producer>(model), nullptr, cfg, comm, opts) {}

dp_trainer::dp_trainer(grad_producer& piece, const train_config& cfg,
                       collective::communicator& comm, const dp_options& opts)
    : dp_trainer(nullptr, &piece, cfg, comm, opts) {}

dp_trainer::dp_trainer(std::unique_ptr<grad_producer> owned, grad_producer* piece,
                       const train_config& cfg, collective::communicator& comm,
                       const dp_options& opts)
    : owned_(std::move(owned)),
      piece_(piece != nullptr ? *piece : *owned_),
      cfg_(cfg),
      comm_(comm),
      opts_(opts),
      plan_(cfg.batch * cfg.grad_accum, cfg.plan.dp, cfg.plan.microbatches) {
  cfg_.validate();
  const int dp = comm.size(), rank = comm.rank();
  const int zero = cfg.plan.zero;
  TROUPE_CHECK(cfg.plan.dp * cfg.plan.cp == dp, "dp_trainer: plan.dp",
               cfg.plan.cp > 1 ? " x plan.cp" : "", " is ", cfg.plan.dp * cfg.plan.cp, " but ",
               comm.name(), " has ", dp, " ranks");
  TROUPE_CHECK(zero >= 0 && zero <= 3, "dp_trainer: parallel.zero = ", zero,
               " is not supported (0 to 3) on rank ", rank, " of ", comm.name());
  TROUPE_CHECK(zero < 3 || cfg.plan.pp == 1, "dp_trainer: parallel.zero = 3 needs parallel.pp = 1",
               " (got pp ", cfg.plan.pp, ") on rank ", rank, " of ", comm.name());
  const tensor& p = piece_.memory().params();
  // The engine steps f32 weights: an f32 piece, or with bf16 / f16 a mixed_piece
  // (mixed_piece.hpp) whose f32 master weights these are; f16's piece scales its loss.
  TROUPE_CHECK(
      p.type() == dtype::f32 && (cfg.precision == "f32" || cfg.precision == "bf16" ||
                                 (cfg.precision == "f16" && piece_.scales_loss())),
      "dp_trainer: the engine steps f32 weights (f32, or bf16 / f16 through mixed_piece), ",
      "got a ", dtype_name(p.type()), " piece", piece_.scales_loss() ? " that scales its loss" : "",
      " and train.precision ", cfg.precision);
  TROUPE_CHECK(cfg.precision != "f16" || !opts.moments,
               "dp_trainer: train.precision f16 with memory tiers is not supported");
  if (cfg.precision == "f16") scaler_.emplace(cfg.loss_scale, cfg.loss_scale_growth);
  TROUPE_CHECK(p.dev() == device::cpu(), "dp_trainer: host models only for now");
  TROUPE_CHECK(piece_.memory().grads().numel() == p.numel(), "dp_trainer: the piece's gradient ",
               "buffer has ", piece_.memory().grads().numel(), " elements, its parameters ",
               p.numel());
  const auto& slots = piece_.slots();
  auto groups = make_groups(slots, p);
  range_list experts;  // own_experts: the expert parameters, each its own bucket range
  if (opts.own_experts) {
    TROUPE_CHECK(zero == 0, "dp_trainer: expert parallelism over pipeline stages runs with ZeRO 0 ",
                 "(parallel.zero 0), got parallel.zero ", zero);
    TROUPE_CHECK(opts.expert_dp != nullptr && opts.expert_group != nullptr &&
                     opts.expert_dp->size() * opts.expert_group->size() == dp,
                 "dp_trainer: own_experts needs an expert-data-parallel and an expert-parallel ",
                 "group whose sizes multiply to the dp group's ", dp);
    for (const auto& s : slots.slots())
      if (s.kind == slot_kind::param && s.spec.expert >= 0 && s.field->numel() > 0)
        experts.emplace_back(flat_offset(s, p), s.field->numel());
    std::sort(experts.begin(), experts.end());
  }
  buckets_ = make_buckets(cut_at(bucket_ranges(groups, slots, p), experts), dp,
                          static_cast<std::int64_t>(opts.bucket_bytes / p.element_size()));
  for (const auto& b : buckets_)
    own_bucket_.push_back(std::any_of(experts.begin(), experts.end(), [&](const auto& e) {
      return b.begin >= e.first && b.begin + b.length <= e.first + e.second;
    }));
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    for (auto& g : groups) {
      for (const auto& [gb, gn] : g.ranges)
        if (buckets_[i].begin >= gb && buckets_[i].begin < gb + gn) g.buckets.push_back(i);
    }
  }
  ops::adamw_options ao{
      .beta1 = cfg.beta1, .beta2 = cfg.beta2, .eps = cfg.eps, .weight_decay = cfg.weight_decay};
  if (zero == 0) {
    full_opt_ = std::make_unique<adamw_optimizer>(p, ao);
    if (cfg.decay_exempt) full_opt_->exempt_from_decay(slots, p, biases_norms_embeddings);
  } else {
    shard_opt_ = std::make_unique<shard_optimizer>(
        buckets_, rank, exempt_mask(slots, p, cfg.decay_exempt), zero >= 2, zero == 3, ao);
    if (opts.moments && zero == 3 && opts.page_shard) {
      shard_opt_->keep_in_shard_tiers(buckets_, *opts.moments);
      paged_ = shard_opt_->shard.get();
    } else if (opts.moments) {
      shard_opt_->keep_in_tiers(*opts.moments);
    } else
      shard_opt_->keep_in_memory();
  }
  TROUPE_CHECK(!opts.moments || zero >= 1, "dp_trainer: moments in memory tiers need ZeRO 1-3 ",
               "(parallel.zero >= 1), got zero 0 on rank ", rank, " of ", comm.name());

  // The norm: every parameter the piece counts (the whole buffer, padding included, when it
  // counts them all: the padding is zero).
  bool all_count = !opts.own_experts;
  range_list counted, counted_experts;
  for (const auto& s : slots.slots()) {
    if (s.kind != slot_kind::param) continue;
    if (!piece_.counts_in_norm(s))
      all_count = false;
    else if (opts.own_experts && s.spec.expert >= 0)
      counted_experts.emplace_back(flat_offset(s, p), s.field->numel());
    else
      counted.emplace_back(flat_offset(s, p), s.field->numel());
  }
  expert_norm_ranges_ = merged(counted_experts);
  norm_ranges_ = all_count ? range_list{{0, p.numel()}} : merged(counted);
  std::int64_t shard = 0;
  for (const auto& b : buckets_) shard += b.chunk;
  if (zero >= 2) {
    if (all_count) {
      shard_norm_ranges_ = {{0, shard}};  // bucket padding reduces to zeros
    } else {
      for (const auto& b : buckets_) {
        auto [begin, end] = own_range(b, rank);
        for (const auto& [rb, rn] : norm_ranges_) {
          std::int64_t lo = std::max(begin, rb), hi = std::min(end, rb + rn);
          if (lo < hi) shard_norm_ranges_.emplace_back(b.shard_offset + lo - begin, hi - lo);
        }
      }
      shard_norm_ranges_ = merged(shard_norm_ranges_);
    }
  }

  // Overlap: the blocks each bucket holds (parameters "<scope>.<i>.*"); a bucket with anything
  // else (embeddings, final norm, head, padding only) waits for the end of forward_backward.
  // ZeRO 2, 3 releasing gradients prefer the microbatch hook (each microbatch reduced).
  if (opts.overlap && zero >= 2 && opts.release_grads)
    per_mb_ = piece_.set_microbatch_grads_hook(
        [this](int k, std::int64_t block) { on_microbatch(k, block); });
  overlap_ =
      opts.overlap &&
      (per_mb_ || piece_.set_block_grads_hook([this](std::int64_t block) { on_block(block); }));
  release_ = zero >= 2 && opts.release_grads && overlap_;
  in_flight_limit_ = static_cast<std::int64_t>(
      (opts.grads_in_flight_bytes > 0 ? opts.grads_in_flight_bytes : 2 * opts.bucket_bytes) /
      p.element_size());
  if (const long page = ::sysconf(_SC_PAGESIZE); page > 0)
    page_elements_ = std::max<std::int64_t>(1, page / static_cast<long>(p.element_size()));
  bucket_blocks_.assign(buckets_.size(), {});
  if (overlap_) {
    std::vector<char> outside(buckets_.size(), 0), any(buckets_.size(), 0);
    std::int64_t blocks = 0;
    for (const auto& s : slots.slots()) {
      if (s.kind != slot_kind::param) continue;
      std::int64_t block = s.block, off = flat_offset(s, p);
      blocks = std::max(blocks, block + 1);
      for (std::size_t i = 0; i < buckets_.size(); ++i) {
        const auto& b = buckets_[i];
        if (off >= b.begin + b.length || off + s.field->numel() <= b.begin) continue;
        any[i] = 1;
        if (block < 0)
          outside[i] = 1;
        else
          bucket_blocks_[i].push_back(block);
      }
    }
    final_.assign(static_cast<std::size_t>(blocks), 0);
    for (std::size_t i = 0; i < buckets_.size(); ++i) {
      auto& bl = bucket_blocks_[i];
      std::sort(bl.begin(), bl.end());
      bl.erase(std::unique(bl.begin(), bl.end()), bl.end());
      if (outside[i] || !any[i]) bl.clear();
      buckets_[i].ready = bl.empty() ? -1 : bl.front();
    }
  }
  issued_.assign(buckets_.size(), 0);
  reduced_.assign(buckets_.size(), 0);
  released_.assign(buckets_.size(), 0);

  pad_at_.assign(buckets_.size(), -1);
  std::int64_t pad = 0;
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    if (!buckets_[i].padded(dp)) continue;
    pad_at_[i] = pad;
    pad += buckets_[i].chunk * dp;
  }
  if (zero >= 2 && pad > 0) pad_in_ = zeros({pad}, dtype::f32, device::cpu());
  if (zero >= 1 && paged_ == nullptr)
    shard_params_ = zeros({std::max<std::int64_t>(shard, 1)}, dtype::f32, device::cpu());
  if (zero >= 2 && paged_ == nullptr)
    shard_grads_ = zeros({std::max<std::int64_t>(shard, 1)}, dtype::f32, device::cpu());
  if (per_mb_ && plan_.microbatches() > 1) {
    std::int64_t most = 1;
    for (const auto& b : buckets_) most = std::max(most, b.chunk);
    // At most a shard's worth is staged at once (each bucket once per microbatch).
    const std::int64_t ring = std::min(in_flight_limit_ / dp + most + 1, shard);
    shard_in_ = zeros({std::max<std::int64_t>(ring, 1)}, dtype::f32, device::cpu());
  }
  // Released gradients read as zeros: the buffer starts given back (layer_memory zeroed it).
  if (release_) piece_.memory().release_grads(0, piece_.memory().grads().numel());
  if (zero >= 1)
    params_ = std::make_unique<param_gather>(
        comm, piece_.memory(), buckets_, shard_params_.view(), std::move(groups),
        param_gather::options{.prefetch = opts.prefetch,
                              .poison = opts.poison_released,
                              .measure_resident = opts.measure_resident,
                              .pins = paged_});
  if (zero == 3) {
    // The rank's chunks become its master parameters (the bucket padding stays zero); the piece's
    // buffer is released until a step gathers it.
    if (paged_ != nullptr) {  // segment by segment, every element written (the padding zeroed)
      paged_->for_each(
          {paged_shard::params},
          [&](std::int64_t first, const tensor(&views)[4]) {
            const tensor& seg = views[paged_shard::params];
            const std::int64_t last = first + seg.numel();
            for (const auto& b : buckets_) {
              if (b.shard_offset < first || b.shard_offset >= last) continue;
              auto [begin, end] = own_range(b, rank);
              float* out = seg.data_as<float>() + (b.shard_offset - first);
              std::memcpy(out, f32_at(p, begin), static_cast<std::size_t>(end - begin) * 4);
              std::fill(out + (end - begin), out + b.chunk, 0.0f);
            }
          },
          true, true);
      paged_->rewind();
    } else {
      for (const auto& b : buckets_) {
        auto [begin, end] = own_range(b, rank);
        std::memcpy(f32_at(shard_params_, b.shard_offset), f32_at(p, begin),
                    static_cast<std::size_t>(end - begin) * 4);
      }
    }
    params_->release_all();
    use_hook_ = piece_.set_block_use_hook(
        [this](std::int64_t block, block_use use) { on_use(block, use); });
  }
}

dp_trainer::~dp_trainer() {
  abandon_pending();  // a failed step's ops (step() drains them too) still use our buffers
  if (per_mb_)
    piece_.set_microbatch_grads_hook({});
  else if (overlap_)
    piece_.set_block_grads_hook({});
  if (use_hook_) piece_.set_block_use_hook({});
}

std::int64_t dp_trainer::peak_gathered_bytes() const {
  return cfg_.plan.zero == 3 ? params_->peak_gathered_bytes()
                             : piece_.memory().params().numel() * 4;
}

std::size_t dp_trainer::peak_resident_param_bytes() const {
  return cfg_.plan.zero == 3 ? params_->peak_resident_bytes() : resident_peak_;
}

std::int64_t dp_trainer::reduced_grad_bytes() const {
  return (shard_grads_.view().defined() ? shard_grads_.view().numel() * 4 : 0) +
         (shard_in_.view().defined() ? shard_in_.view().numel() * 4 : 0);
}

void dp_trainer::on_use(std::int64_t block, block_use use) {
  if (running_) params_->on_use(block, use);
}

memory::tier_manager* dp_trainer::moment_tiers_manager() {
  if (paged_ != nullptr) return &paged_->tiers();
  return shard_opt_ && shard_opt_->paged ? &shard_opt_->paged->tiers() : nullptr;
}

std::int64_t dp_trainer::optimizer_elements() const {
  return full_opt_ ? full_opt_->m().numel() : shard_opt_->elements;
}

dp_trainer::optimizer_view dp_trainer::optimizer_state() const {
  optimizer_view out;
  if (full_opt_) {
    out.m = full_opt_->m();
    out.v = full_opt_->v();
    out.runs.push_back({0, 0, full_opt_->m().numel()});
    out.steps = full_opt_->steps_taken();
    out.whole = true;
    return out;
  }
  shard_opt_->take_copy();  // paged: a copy (the next update writes it back)
  out.m = shard_opt_->m;
  out.v = shard_opt_->v;
  for (const auto& p : shard_opt_->pieces) out.runs.push_back({p.flat, p.state, p.length});
  out.steps = shard_opt_->steps;
  return out;
}

void dp_trainer::set_progress(std::int64_t steps_done, std::int64_t optimizer_steps) {
  TROUPE_CHECK(steps_done >= 0 && optimizer_steps >= 0 && optimizer_steps <= steps_done,
               "dp_trainer: cannot resume at step ", steps_done, " with ", optimizer_steps,
               " optimizer steps");
  step_ = steps_done;
  if (full_opt_)
    full_opt_->set_steps_taken(optimizer_steps);
  else
    shard_opt_->steps = optimizer_steps;
}

void dp_trainer::read_rows(std::int64_t begin, std::int64_t end,
                           const trainer::batch_source& data) {
  const std::int64_t b = cfg_.batch, t = cfg_.seq, g = cfg_.batch * cfg_.grad_accum;
  rows_.resize(static_cast<std::size_t>((end - begin) * t));
  for (std::int64_t i = begin; i < end; ++i) {
    // The single process reads sample i of the stream as row i mod batch of draw i / batch (draw
    // 0 for every micro-batch with fixed_batch).
    std::uint64_t draw = cfg_.fixed_batch ? 0 : static_cast<std::uint64_t>(i / b);
    std::int64_t row = cfg_.fixed_batch ? (i % g) % b : i % b;
    if (draw != cached_draw_) {
      data(draw, static_cast<int>(b), static_cast<int>(t), draw_rows_);
      TROUPE_CHECK(static_cast<std::int64_t>(draw_rows_.size()) == b * t,
                   "dp_trainer: the data source gave ", draw_rows_.size(), " tokens for draw ",
                   draw, ", expected ", b * t);
      cached_draw_ = draw;
    }
    std::copy_n(draw_rows_.begin() + row * t, t, rows_.begin() + (i - begin) * t);
  }
}

microbatch_data dp_trainer::fetch(int k, const trainer::batch_source& data) {
  const int rank = comm_.rank();
  const int data_rank = rank / cfg_.plan.cp;  // the cp ranks of a replica read the same rows
  TROUPE_CHECK(k >= next_fetch_ && k < plan_.microbatches(), "dp_trainer: rank ", rank, " of ",
               comm_.name(), ": the piece fetched microbatch ", k, " (microbatches are fetched in ",
               "ascending order, each at most once, of ", plan_.microbatches(), "; next is ",
               next_fetch_, ")");
  next_fetch_ = k + 1;
  auto range = plan_.range(data_rank, k, step_);
  if (samples_ != nullptr) {
    microbatch_data mb = (*samples_)({.step = step_,
                                      .begin = range.begin,
                                      .end = range.end,
                                      .weight = plan_.weight(data_rank, k)});
    TROUPE_CHECK(mb.ids.defined() && mb.ids.dim() == 2 && mb.ids.size(0) == range.size() &&
                     mb.ids.size(1) == cfg_.seq && mb.targets.defined() &&
                     mb.targets.sizes() == mb.ids.sizes(),
                 "dp_trainer: rank ", rank, " of ", comm_.name(), ": the sample source gave ",
                 describe(mb.ids), " ids and ", describe(mb.targets), " targets for samples ",
                 range.begin, "..", range.end, ", expected i32 [", range.size(), ", ", cfg_.seq,
                 "] each");
    return mb;
  }
  read_rows(range.begin, range.end, data);
  const int rows = static_cast<int>(range.size()), t = static_cast<int>(cfg_.seq);
  targets_.resize(rows_.size());
  microbatch_data mb;
  mb.ids = tensor(rows_.data(), rows_.size() * 4, dtype::i32, {rows, t});
  mb.targets = tensor(targets_.data(), targets_.size() * 4, dtype::i32, {rows, t});
  next_token_targets(mb.ids, mb.targets);
  mb.weight = plan_.weight(data_rank, k);
  return mb;
}

void dp_trainer::on_block(std::int64_t block) {
  if (!running_ || block < 0 || block >= static_cast<std::int64_t>(final_.size())) return;
  sample_grads();  // block's gradients are written, not issued yet
  final_[static_cast<std::size_t>(block)] = 1;
  issue_ready();
  if (release_) poll();
  sample_grads();
}

void dp_trainer::on_microbatch(int k, std::int64_t block) {
  if (!running_) return;
  if (block >= 0) return on_block(block);
  // Microbatch k's backward is complete. Its block buckets must be reduced (and their ranges
  // given back) before the next microbatch's backward writes them again.
  for (std::size_t i = 0; i < buckets_.size(); ++i)
    TROUPE_CHECK(bucket_blocks_[i].empty() || issued_[i], "dp_trainer: rank ", comm_.rank(), " of ",
                 comm_.name(), ": microbatch ", k, "'s backward ended before the piece ",
                 "reported block ", bucket_blocks_[i].front(), " final");
  if (k + 1 >= plan_.microbatches()) return;
  wait_pending();
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    if (bucket_blocks_[i].empty()) continue;
    issued_[i] = 0;
    released_[i] = 0;
  }
  std::fill(final_.begin(), final_.end(), 0);
}

void dp_trainer::issue_ready() {
  for (std::size_t i = 0; i < buckets_.size(); ++i) {
    const auto& bl = bucket_blocks_[i];
    if (issued_[i] || bl.empty()) continue;
    bool ready = std::all_of(bl.begin(), bl.end(),
                             [&](std::int64_t b) { return final_[static_cast<std::size_t>(b)]; });
    if (!ready) continue;
    issue_bucket(i);
    ++early_;
  }
}

void dp_trainer::issue_bucket(std::size_t i) {
  const dp_bucket& b = buckets_[i];
  issued_[i] = 1;
  if (own_bucket_[i]) {  // this rank's experts: over the ranks holding the same ones
    if (opts_.expert_dp->size() > 1)
      pending_.push_back({i,
                          opts_.expert_dp->allreduce(f32_at(piece_.memory().grads(), b.begin),
                                                     b.length, dtype::f32),
                          -1});
    return;
  }
  const tensor& g = piece_.memory().grads();
  const int dp = comm_.size();
  if (cfg_.plan.zero < 2) {
    pending_.push_back({i, comm_.allreduce(f32_at(g, b.begin), b.length, dtype::f32), -1});
    return;
  }
  const float* in = f32_at(g, b.begin);
  bool staged = false;
  if (b.padded(dp)) {
    float* stage = f32_at(pad_in_, pad_at_[i]);
    std::memcpy(stage, in, static_cast<std::size_t>(b.length) * 4);
    std::fill(stage + b.length, stage + b.chunk * dp, 0.0f);
    in = stage;
    staged = true;
  }
  // Back-pressure: wait for the oldest until this one fits (a paged shard pins a gradient
  // segment per bucket in flight, so it holds them to the limit too).
  if (release_ || paged_ != nullptr)
    while (!pending_.empty() && in_flight_ + b.length > in_flight_limit_) wait_oldest();
  // The first reduction of the step lands in the shard; later ones (microbatches) are added.
  const std::int64_t at = reduced_[i] != 0 ? staging_for(b.chunk) : -1;
  reduced_[i] = 1;
  if (paged_ != nullptr) {  // the bucket's gradient chunk pinned from now until it is done
    float* grads = paged_->pin_grads(i);
    float* out = at >= 0 ? f32_at(shard_in_, at) : grads;
    try {
      pending_.push_back({i, comm_.reduce_scatter(in, out, b.chunk, dtype::f32), at, grads});
    } catch (...) {
      paged_->unpin_grads(i);
      throw;
    }
  } else {
    float* out = at >= 0 ? f32_at(shard_in_, at) : f32_at(shard_grads_, b.shard_offset);
    pending_.push_back({i, comm_.reduce_scatter(in, out, b.chunk, dtype::f32), at});
  }
  in_flight_ += b.length;
  in_flight_peak_ = std::max(in_flight_peak_, in_flight_);
  if (release_ && staged) release_run(i);  // the op reads the staging copy
}

void dp_trainer::finish_oldest() {
  pending_.front().work.wait();
  // Off the list before anything else can throw, so that no op is finished (added) twice.
  const std::size_t i = pending_.front().bucket;
  const std::int64_t at = pending_.front().at;
  float* grads = pending_.front().grads;
  pending_.pop_front();
  if (cfg_.plan.zero < 2) return;
  const dp_bucket& b = buckets_[i];
  in_flight_ -= b.length;
  if (grads != nullptr) {  // paged: add into the pinned chunk, then unpin it
    try {
      if (at >= 0) {
        tensor acc(grads, static_cast<std::size_t>(b.chunk) * 4, dtype::f32, {b.chunk},
                   device::cpu());
        ops::add(acc, shard_in_.view().narrow(0, at, b.chunk), acc);
      }
    } catch (...) {
      paged_->unpin_grads(i);
      throw;
    }
    paged_->unpin_grads(i);
  } else if (at >= 0) {
    auto acc = shard_grads_.view().narrow(0, b.shard_offset, b.chunk);
    ops::add(acc, shard_in_.view().narrow(0, at, b.chunk), acc);
  }
  if (release_ && !released_[i]) release_run(i);
}

void dp_trainer::poll() {  // oldest first (the staging ring frees in issue order)
  while (!pending_.empty() && pending_.front().work.test()) finish_oldest();
}

void dp_trainer::wait_pending() {
  auto t0 = clock_type::now();
  while (!pending_.empty()) finish_oldest();
  comm_wait_ += seconds_since(t0);
}

void dp_trainer::wait_oldest() {
  auto t0 = clock_type::now();
  finish_oldest();
  comm_wait_ += seconds_since(t0);
}

void dp_trainer::abandon_pending() noexcept {
  for (auto& op : pending_) {
    try {
      op.work.wait();  // a failed op is finished too
    } catch (...) {
    }
    try {
      if (op.grads != nullptr) paged_->unpin_grads(op.bucket);
    } catch (...) {
    }
  }
  pending_.clear();
  in_flight_ = 0;
  ring_head_ = 0;
}

std::int64_t dp_trainer::staging_for(std::int64_t chunk) {
  const std::int64_t size = shard_in_.numel();
  for (;;) {
    std::int64_t tail = -1;  // the oldest staged op's place: [tail, ring_head_) is in use
    for (const auto& op : pending_)
      if (op.at >= 0) {
        tail = op.at;
        break;
      }
    if (tail < 0) ring_head_ = 0;
    std::int64_t at = -1;
    if (tail < 0 || ring_head_ > tail) {  // free: [ring_head_, size) and [0, tail)
      if (ring_head_ + chunk <= size)
        at = ring_head_;
      else if (chunk < tail)
        at = 0;
    } else if (ring_head_ + chunk < tail) {  // wrapped: free [ring_head_, tail)
      at = ring_head_;
    }
    if (at >= 0) {
      ring_head_ = at + chunk;
      return at;
    }
    TROUPE_CHECK(!pending_.empty(), "dp_trainer: a chunk of ", chunk,
                 " elements does not fit the staging ring of ", size);
    wait_oldest();
  }
}

void dp_trainer::release_run(std::size_t i) {
  // Buckets are listed from the end of the buffer, each just below the one before. Bucket i's
  // range goes, widened over the released neighbours up to the pages holding its ends: a page it
  // shares with a released neighbour is then whole and goes too (one shared with a bucket still in
  // use stays until that one is released). The rest of the neighbours' ranges went with them.
  released_[i] = 1;
  const std::int64_t page = page_elements_;
  const dp_bucket& b = buckets_[i];
  std::int64_t begin = b.begin, end = b.begin + b.length;
  const std::int64_t end_page = (end + page - 1) / page * page, begin_page = begin / page * page;
  for (std::size_t j = i; j > 0 && end < end_page && released_[j - 1]; --j)  // higher addresses
    end = std::min(end_page, buckets_[j - 1].begin + buckets_[j - 1].length);
  for (std::size_t j = i + 1; j < buckets_.size() && begin > begin_page && released_[j]; ++j)
    begin = std::max(begin_page, buckets_[j].begin);
  piece_.memory().release_grads(begin, end - begin);
}

void dp_trainer::sample_grads() {
  if (opts_.measure_resident)
    grad_resident_peak_ = std::max(grad_resident_peak_, piece_.memory().resident_grad_bytes());
}

double dp_trainer::sum_squares(const tensor& t, const range_list& ranges) const {
  double sq = 0;
  for (const auto& [b, n] : ranges)
    sq += b == 0 && n == t.numel() ? ops::sum_squares(t) : ops::sum_squares(t.narrow(0, b, n));
  return sq;
}

// One flag per rank, summed over the dp group and then over the piece's norm group (the model
// parallel ranks of the replica): every rank of the grid gets the same answer. Each rank checks its
// own gradients before the reduction (mixed_piece::grads_finite: every parameter, whether this
// rank counts it in the norm or not), so a ZeRO 2 / 3 chunk another rank reduces, or a replica of
// a LayerNorm another tensor shard counts, is covered too.
bool dp_trainer::any_rank_overflowed() {
  double flag = piece_.grads_finite() ? 0.0 : 1.0;
  auto t0 = clock_type::now();
  if (comm_.size() > 1) comm_.allreduce(&flag, 1, dtype::f64).wait();
  if (auto* mp = piece_.norm_group(); mp != nullptr && mp->size() > 1)
    mp->allreduce(&flag, 1, dtype::f64).wait();
  comm_wait_ += seconds_since(t0);
  return flag > 0.0;
}

double dp_trainer::reduce_gradients() {
  wait_pending();
  auto t0 = clock_type::now();
  // zero 0, 1: the full gradient, the same on every dp rank; zero 2, 3: the shards (the padding
  // of the short bucket reduces to zeros, so the shard's squares are exactly its elements').
  const bool sharded = cfg_.plan.zero >= 2;
  const tensor& g = sharded ? shard_grads_.view() : piece_.memory().grads();
  double sq = 0;
  if (paged_ != nullptr) {  // segment by segment, as ops::sum_squares adds (paged_shard.hpp)
    for (const auto& [b, n] : shard_norm_ranges_) sq += paged_->grad_sum_squares(b, n);
  } else {
    sq = sum_squares(g, sharded ? shard_norm_ranges_ : norm_ranges_);
  }
  if (sharded) comm_.allreduce(&sq, 1, dtype::f64).wait();
  if (opts_.own_experts) {  // the ranks of the ep group hold disjoint experts
    double own = sum_squares(g, expert_norm_ranges_);
    if (opts_.expert_group->size() > 1) opts_.expert_group->allreduce(&own, 1, dtype::f64).wait();
    sq += own;
  }
  if (auto* mp = piece_.norm_group(); mp != nullptr) mp->allreduce(&sq, 1, dtype::f64).wait();
  comm_wait_ += seconds_since(t0);
  double norm = std::sqrt(sq);
  if (paged_ != nullptr)
    paged_clip_ = clip_factor(norm, cfg_.clip);  // the update scales each segment
  else if (const double f = clip_factor(norm, cfg_.clip); f != 1.0)
    ops::scale(g, f);
  return norm;
}

void dp_trainer::stage_shard() {
  const tensor& p = piece_.memory().params();
  const int rank = comm_.rank();
  for (const auto& b : buckets_) {  // stage the updated chunks (no in-place all_gather)
    float* in = f32_at(shard_params_, b.shard_offset);
    auto [begin, end] = own_range(b, rank);
    std::memcpy(in, f32_at(p, begin), static_cast<std::size_t>(end - begin) * 4);
    std::fill(in + (end - begin), in + b.chunk, 0.0f);
  }
}

void dp_trainer::gather_parameters() {
  stage_shard();
  params_->gather_all();
  comm_wait_ += params_->take_wait_seconds();
}

void dp_trainer::gather_full_parameters() {
  if (cfg_.plan.zero == 3) params_->gather_all();
  if (gather_due_) {
    params_->gather_all();
    gather_due_ = false;
  }
}

tensor dp_trainer::shard_parameters() {
  if (cfg_.plan.zero == 0 || paged_ != nullptr) return {};
  if (cfg_.plan.zero < 3 && !gather_due_) {
    stage_shard();
    gather_due_ = opts_.defer_gather;
  }
  return shard_params_.view();
}

step_result dp_trainer::step(const trainer::batch_source& data) {
  prepare(data);
  return commit();
}

step_result dp_trainer::step(const sample_source& samples) {
  TROUPE_CHECK(cfg_.plan.cp == 1, "dp_trainer: post-training samples need whole sequences on ",
               "each rank: parallel.cp must be 1, got ", cfg_.plan.cp);
  samples_ = &samples;
  piece_.set_every_stage_reads(true);  // a microbatch's packed rows reach every stage
  try {
    prepare(trainer::batch_source{});
  } catch (...) {
    samples_ = nullptr;
    piece_.set_every_stage_reads(false);
    throw;
  }
  samples_ = nullptr;
  piece_.set_every_stage_reads(false);
  return commit();
}

void dp_trainer::prepare(const trainer::batch_source& data) {
  TROUPE_CHECK(!prepared_, "dp_trainer: step ", step_ + 1, " is prepared already (commit it)");
  auto t0 = clock_type::now();
  prepared_t0_ = t0;
  comm_wait_ = 0;
  early_ = 0;
  resident_peak_ = 0;
  cached_draw_ = ~std::uint64_t{0};
  const int zero = cfg_.plan.zero;
  auto& mem = piece_.memory();
  if (paged_ != nullptr) {
    shard_opt_->put_back_copy();  // a copy optimizer_state() took (off the schedule)
    paged_->begin_step();
  }
  // Released gradients read as zeros: after a complete step every bucket was given back.
  if (!release_ || grads_dirty_) mem.zero_grads();
  grads_dirty_ = release_;
  grad_resident_peak_ = 0;
  in_flight_peak_ = 0;
  std::fill(issued_.begin(), issued_.end(), 0);
  std::fill(reduced_.begin(), reduced_.end(), 0);
  std::fill(released_.begin(), released_.end(), 0);
  std::fill(final_.begin(), final_.end(), 0);
  next_fetch_ = 0;
  running_ = true;
  double loss = 0;
  step_result r;
  collective::work loss_work;
  try {
    // Inside the try: begin_step waits for the first gathers, which fail when a peer is lost.
    if (zero == 3) params_->begin_step(plan_.microbatches(), use_hook_);
    if (gather_due_) {  // defer_gather: the last commit (or a restored shard) updated the shards
      params_->gather_all();
      comm_wait_ += params_->take_wait_seconds();
      gather_due_ = false;
    }
    prepared_scale_ = scaler_ ? scaler_->scale() : 1.0;
    // f16: every token's loss is scaled as in the single process (mixed_piece.hpp).
    if (scaler_) piece_.set_loss_scale(prepared_scale_ * static_cast<double>(cfg_.grad_accum));
    loss = piece_.forward_backward(plan_.microbatches(), [&](int k) { return fetch(k, data); });
    running_ = false;
    if (zero == 3) {
      params_->end_step();  // nothing stays gathered: the update goes to the shard
      comm_wait_ += params_->take_wait_seconds();
    } else if (opts_.measure_resident) {
      resident_peak_ = std::max(resident_peak_, mem.resident_param_bytes());
    }
    sample_grads();
    // Every microbatch, or none: a middle pipeline stage reads no data (its inputs come from the
    // previous stage).
    TROUPE_CHECK(next_fetch_ == plan_.microbatches() || next_fetch_ == 0, "dp_trainer: rank ",
                 comm_.rank(), " of ", comm_.name(), ": the piece fetched ", next_fetch_, " of ",
                 plan_.microbatches(), " microbatches");
    // What the end of backward made final (everything without overlap), in bucket order.
    for (std::size_t i = 0; i < buckets_.size(); ++i)
      if (!issued_[i]) issue_bucket(i);
    loss_work = comm_.allreduce(&loss, 1, dtype::f64);
    prepared_overflow_ = scaler_ && any_rank_overflowed();
    // A skipped step's gradients are dropped: no norm, no clipping (the single process's order).
    r.grad_norm = prepared_overflow_ ? 0.0 : reduce_gradients();
    if (prepared_overflow_) wait_pending();
    // Finite gradients whose f32 sum over the ranks overflowed: the norm, the same on every rank.
    if (scaler_ && !std::isfinite(r.grad_norm)) prepared_overflow_ = true;
    loss_work.wait();
  } catch (...) {
    // Nothing may still read or write this step's buffers once it unwinds: the loss allreduce
    // (into this frame), the bucket ops in flight (the next step zeroes the gradient buffer,
    // grads_dirty_), the gathers in flight (zero 3).
    running_ = false;
    try {
      if (loss_work.valid()) loss_work.wait();
    } catch (...) {
    }
    abandon_pending();
    if (paged_ != nullptr) paged_->abandon_step();
    // Gathers in flight write into the piece's buffer (zero 1, 2 with defer_gather: the shards
    // stay the copy of record, gathered again next step).
    if (params_) params_->abandon();
    if (zero == 3) {
      try {
        params_->end_step();
      } catch (...) {
      }
    }
    throw;
  }
  grads_dirty_ = false;  // every bucket was reduced and, when releasing, given back
  prepared_ = true;
  prepared_loss_ = loss;
  prepared_norm_ = r.grad_norm;
}

step_result dp_trainer::commit() {
  TROUPE_CHECK(prepared_, "dp_trainer: commit of step ", step_ + 1, " before it was prepared");
  prepared_ = false;
  const int zero = cfg_.plan.zero;
  auto& mem = piece_.memory();
  step_result r;
  r.grad_norm = prepared_norm_;
  r.lr = warmup_cosine_lr(step_, cfg_.warmup, cfg_.steps, cfg_.lr, cfg_.min_lr);
  if (scaler_) {
    r.loss_scale = prepared_scale_;
    r.skipped = scaler_->update(prepared_overflow_);
  }
  if (r.skipped) {
    // No update: the parameters (and zero 1, 2's gathered copy) stay as they are; paged shards
    // are refused with f16.
  } else if (full_opt_) {
    full_opt_->step(mem.params(), mem.grads(), r.lr);
  } else if (paged_ != nullptr) {
    shard_opt_->step_paged(r.lr, paged_clip_);
    paged_->end_step();
  } else if (zero == 3) {
    shard_opt_->step(shard_params_, shard_grads_, r.lr);
  } else {
    shard_opt_->step(mem.params(), zero == 2 ? shard_grads_.view() : mem.grads(), r.lr);
    if (opts_.defer_gather) {  // local: the next prepare all-gathers the shards
      stage_shard();
      gather_due_ = true;
    } else {
      gather_parameters();
    }
  }
  ++step_;
  r.step = step_;
  r.loss = prepared_loss_;
  r.tokens = cfg_.batch * cfg_.seq * cfg_.grad_accum;
  r.seconds = seconds_since(prepared_t0_);
  return r;
}

void dp_trainer::discard_prepared() {
  if (!prepared_) return;
  prepared_ = false;
  grads_dirty_ = true;  // the next step zeroes the gradient buffer first
}

}  // namespace troupe::models::parallel
