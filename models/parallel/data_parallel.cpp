// dp_trainer: the data-parallel step (see data_parallel.hpp).
#include "models/parallel/data_parallel.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "memory/error.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {
namespace {

using clock_type = std::chrono::steady_clock;

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

float* f32_at(const tensor& t, std::int64_t offset) {
  return static_cast<float*>(t.data()) + offset;
}

void wait_all(std::vector<collective::work>& works) {
  for (auto& w : works) w.wait();
  works.clear();
}

// This rank's part of bucket b: [begin, end) of the flat buffer (may be empty).
std::pair<std::int64_t, std::int64_t> own_range(const dp_bucket& b, int rank) {
  std::int64_t begin = std::min(b.begin + rank * b.chunk, b.begin + b.length);
  std::int64_t end = std::min(begin + b.chunk, b.begin + b.length);
  return {begin, end};
}

// Which elements of the flat parameter buffer are exempt from weight decay.
std::vector<bool> exempt_mask(causal_lm& model, bool decay_exempt) {
  const tensor& p = model.memory().params();
  std::vector<bool> exempt(static_cast<std::size_t>(p.numel()), false);
  if (!decay_exempt) return exempt;
  const auto elem = static_cast<std::ptrdiff_t>(p.element_size());
  for (const auto& s : model.slots().slots()) {
    if (s.kind != slot_kind::param || !biases_norms_embeddings(s.name, s.sizes.rank())) continue;
    std::ptrdiff_t off =
        (static_cast<const char*>(s.field->data()) - static_cast<const char*>(p.data())) / elem;
    TROUPE_CHECK(off >= 0 && off + s.field->numel() <= p.numel(), "dp_trainer: parameter '", s.name,
                 "' does not live in the flat parameter buffer");
    std::fill_n(exempt.begin() + off, s.field->numel(), true);
  }
  return exempt;
}

// The block of a parameter named "<scope>.<i>.<rest>" (h.3.attn.c_attn.weight, layers.0.mlp...),
// or -1.
std::int64_t block_of(const std::string& name) {
  auto a = name.find('.');
  if (a == std::string::npos) return -1;
  auto b = name.find('.', a + 1);
  if (b == std::string::npos || b == a + 1) return -1;
  std::int64_t v = 0;
  for (auto i = a + 1; i < b; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

}  // namespace

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

// AdamW over the chunks this rank owns: moments only for them, cut into runs of equal decay.
struct dp_trainer::shard_optimizer {
  struct piece {
    std::int64_t flat = 0, length = 0;  // in the flat parameter buffer
    std::int64_t grad = 0;              // in the gradient tensor step() is given
    std::int64_t state = 0;             // in m and v
    bool decay = true;
  };
  ops::adamw_options opt;
  std::vector<piece> pieces;
  owned_tensor m, v;
  std::int64_t steps = 0;

  // grad_in_shard: the gradients come as the shard buffer (zero 2), else as the flat buffer.
  shard_optimizer(const std::vector<dp_bucket>& buckets, int rank, const std::vector<bool>& exempt,
                  bool grad_in_shard, const ops::adamw_options& o)
      : opt(o) {
    std::int64_t state = 0;
    for (const auto& b : buckets) {
      auto [begin, end] = own_range(b, rank);
      for (std::int64_t i = begin; i < end;) {
        std::int64_t j = i;
        while (j < end && exempt[j] == exempt[i]) ++j;
        std::int64_t grad = grad_in_shard ? b.shard_offset + (i - begin) : i;
        pieces.push_back({i, j - i, grad, state, !exempt[i]});
        state += j - i;
        i = j;
      }
    }
    m = zeros({std::max<std::int64_t>(state, 1)}, dtype::f32, device::cpu());
    v = zeros({std::max<std::int64_t>(state, 1)}, dtype::f32, device::cpu());
    elements = state;
  }
  std::int64_t elements = 0;

  void step(const tensor& params, const tensor& grads, double lr) {
    ++steps;
    ops::adamw_options o = opt;
    o.lr = lr;
    o.step = steps;
    for (const auto& p : pieces) {
      o.weight_decay = p.decay ? opt.weight_decay : 0.0;
      ops::adamw(params.narrow(0, p.flat, p.length), grads.narrow(0, p.grad, p.length),
                 m.narrow(0, p.state, p.length), v.narrow(0, p.state, p.length), o);
    }
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
    : model_(model),
      cfg_(cfg),
      comm_(comm),
      opts_(opts),
      plan_(cfg.batch * cfg.grad_accum, cfg.plan.dp, cfg.plan.microbatches) {
  cfg_.validate();
  TROUPE_CHECK(cfg.plan.dp == comm.size(), "dp_trainer: plan.dp is ", cfg.plan.dp, " but ",
               comm.name(), " has ", comm.size(), " ranks");
  TROUPE_CHECK(cfg.plan.zero >= 0 && cfg.plan.zero <= 2, "dp_trainer: zero stage ", cfg.plan.zero,
               " is not supported (0, 1 or 2) on rank ", comm.rank());
  const tensor& p = model.memory().params();
  TROUPE_CHECK(p.type() == dtype::f32 && cfg.precision == "f32",
               "dp_trainer: only f32 training is supported, got a ", dtype_name(p.type()),
               " model and precision ", cfg.precision);
  TROUPE_CHECK(p.dev() == device::cpu(), "dp_trainer: host models only for now");
  const int dp = comm.size();
  buckets_ =
      make_buckets(p.numel(), dp, static_cast<std::int64_t>(opts.bucket_bytes / p.element_size()));
  ops::adamw_options ao{
      .beta1 = cfg.beta1, .beta2 = cfg.beta2, .eps = cfg.eps, .weight_decay = cfg.weight_decay};
  if (cfg.plan.zero == 0) {
    full_opt_ = std::make_unique<adamw_optimizer>(p, ao);
    if (cfg.decay_exempt) full_opt_->exempt_from_decay(model.slots(), p, biases_norms_embeddings);
  } else {
    shard_opt_ = std::make_unique<shard_optimizer>(
        buckets_, comm.rank(), exempt_mask(model, cfg.decay_exempt), cfg.plan.zero == 2, ao);
  }
  // When each bucket's gradients are final: event e < blocks_ is block blocks_ - 1 - e's backward,
  // event blocks_ the end of backward (embeddings, final norm, head: and anything else).
  overlap_ = opts.overlap && model.set_block_grads_hook([this](std::int64_t block) {
    if (!issuing_) return;
    auto before = works_.size();
    issue_ready(blocks_ - 1 - block);
    early_ += static_cast<std::int64_t>(works_.size() - before);
  });
  const auto elem = static_cast<std::ptrdiff_t>(p.element_size());
  for (const auto& s : model.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    std::int64_t block = overlap_ ? block_of(s.name) : -1;
    blocks_ = std::max(blocks_, block + 1);
  }
  for (auto& b : buckets_) b.ready = blocks_;
  if (overlap_) {
    for (auto& b : buckets_) b.ready = -1;
    for (const auto& s : model.slots().slots()) {
      if (s.kind != slot_kind::param) continue;
      std::int64_t block = block_of(s.name);
      std::int64_t event = block < 0 ? blocks_ : blocks_ - 1 - block;
      std::int64_t off =
          (static_cast<const char*>(s.field->data()) - static_cast<const char*>(p.data())) / elem;
      for (auto& b : buckets_)
        if (off < b.begin + b.length && off + s.field->numel() > b.begin)
          b.ready = std::max(b.ready, event);
    }
    for (auto& b : buckets_)
      if (b.ready < 0) b.ready = blocks_;  // padding only
  }
  std::int64_t shard = 0;
  for (const auto& b : buckets_) {
    shard += b.chunk;
    if (b.padded(dp)) {
      pad_in_ = zeros({b.chunk * dp}, dtype::f32, device::cpu());
      pad_out_ = zeros({b.chunk * dp}, dtype::f32, device::cpu());
    }
  }
  if (cfg.plan.zero >= 1)
    shard_params_ = zeros({std::max<std::int64_t>(shard, 1)}, dtype::f32, device::cpu());
  if (cfg.plan.zero == 2)
    shard_grads_ = zeros({std::max<std::int64_t>(shard, 1)}, dtype::f32, device::cpu());
}

dp_trainer::~dp_trainer() {
  if (overlap_) model_.set_block_grads_hook({});
}

std::int64_t dp_trainer::optimizer_elements() const {
  return full_opt_ ? full_opt_->m().numel() : shard_opt_->elements;
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

void dp_trainer::issue_ready(std::int64_t event) {
  for (const auto& b : buckets_)
    if (b.ready == event) issue_bucket(b);
}

void dp_trainer::issue_bucket(const dp_bucket& b) {
  const tensor& g = model_.memory().grads();
  const int dp = comm_.size();
  if (cfg_.plan.zero < 2) {
    works_.push_back(comm_.allreduce(f32_at(g, b.begin), b.length, dtype::f32));
    return;
  }
  const float* in = f32_at(g, b.begin);
  if (b.padded(dp)) {
    std::memcpy(pad_in_.data(), in, static_cast<std::size_t>(b.length) * 4);
    std::fill(f32_at(pad_in_, b.length), f32_at(pad_in_, b.chunk * dp), 0.0f);
    in = f32_at(pad_in_, 0);
  }
  works_.push_back(
      comm_.reduce_scatter(in, f32_at(shard_grads_, b.shard_offset), b.chunk, dtype::f32));
}

double dp_trainer::reduce_gradients() {
  auto t0 = clock_type::now();
  wait_all(works_);
  if (cfg_.plan.zero < 2) {
    comm_wait_ += seconds_since(t0);
    return clip_grad_norm(model_.memory().grads(), cfg_.clip);
  }
  // The padding of the short bucket reduces to zeros, so the shard's squares are exactly its
  // elements'.
  double sq = ops::sum_squares(shard_grads_);
  comm_.allreduce(&sq, 1, dtype::f64).wait();
  comm_wait_ += seconds_since(t0);
  double norm = std::sqrt(sq);
  if (cfg_.clip > 0 && norm > cfg_.clip) ops::scale(shard_grads_, cfg_.clip / (norm + 1e-6));
  return norm;
}

void dp_trainer::gather_parameters() {
  const tensor& p = model_.memory().params();
  const int dp = comm_.size(), rank = comm_.rank();
  std::vector<collective::work> works;
  works.reserve(buckets_.size());
  for (const auto& b : buckets_) {
    auto [begin, end] = own_range(b, rank);
    float* in = f32_at(shard_params_, b.shard_offset);
    std::memcpy(in, f32_at(p, begin), static_cast<std::size_t>(end - begin) * 4);
    std::fill(in + (end - begin), in + b.chunk, 0.0f);
    float* out = b.padded(dp) ? f32_at(pad_out_, 0) : f32_at(p, b.begin);
    works.push_back(comm_.all_gather(in, out, b.chunk, dtype::f32));
  }
  auto t0 = clock_type::now();
  wait_all(works);
  comm_wait_ += seconds_since(t0);
  for (const auto& b : buckets_)
    if (b.padded(dp))
      std::memcpy(f32_at(p, b.begin), pad_out_.data(), static_cast<std::size_t>(b.length) * 4);
}

step_result dp_trainer::step(const trainer::batch_source& data) {
  auto t0 = clock_type::now();
  comm_wait_ = 0;
  early_ = 0;
  cached_draw_ = ~std::uint64_t{0};
  auto& mem = model_.memory();
  const int rank = comm_.rank();
  const int t = static_cast<int>(cfg_.seq);
  mem.zero_grads();
  double loss = 0;
  for (int m = 0; m < plan_.microbatches(); ++m) {
    auto range = plan_.range(rank, m, step_);
    read_rows(range.begin, range.end, data);
    const int rows = static_cast<int>(range.size());
    targets_.resize(rows_.size());
    tensor ids(rows_.data(), rows_.size() * 4, dtype::i32, {rows, t});
    tensor tg(targets_.data(), targets_.size() * 4, dtype::i32, {rows, t});
    next_token_targets(ids, tg);
    const double w = plan_.weight(rank, m);
    loss += w * model_.forward(ids, tg);
    // The last microbatch's backward makes the gradients final: buckets may start during it.
    issuing_ = m + 1 == plan_.microbatches();
    try {
      model_.backward(w);  // the gradient of w * loss: the group's sum is the step's mean
    } catch (...) {
      issuing_ = false;
      throw;
    }
    issuing_ = false;
  }
  issue_ready(blocks_);  // what the end of backward made final (everything without overlap)
  auto loss_work = comm_.allreduce(&loss, 1, dtype::f64);

  step_result r;
  r.grad_norm = reduce_gradients();
  loss_work.wait();
  r.lr = warmup_cosine_lr(step_, cfg_.warmup, cfg_.steps, cfg_.lr, cfg_.min_lr);
  if (full_opt_) {
    full_opt_->step(mem.params(), mem.grads(), r.lr);
  } else {
    shard_opt_->step(mem.params(), cfg_.plan.zero == 2 ? shard_grads_.view() : mem.grads(), r.lr);
    gather_parameters();
  }
  ++step_;
  r.step = step_;
  r.loss = loss;
  r.tokens = cfg_.batch * cfg_.seq * cfg_.grad_accum;
  r.seconds = seconds_since(t0);
  return r;
}

}  // namespace troupe::models::parallel
