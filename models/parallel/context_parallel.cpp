// Ulysses context parallelism (context_parallel.hpp): the exchange over a communicator and the
// piece that runs a whole model on this rank's part of the sequence.
#include "models/parallel/context_parallel.hpp"

#include <algorithm>
#include <utility>
#include <variant>

#include "memory/error.hpp"
#include "models/families.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

namespace {

// `slot` holding at least s's elements of type t (reallocated when not), viewed as s.
tensor grown(owned_tensor& slot, const shape& s, dtype t) {
  const std::int64_t n = s.numel();
  if (!slot.defined() || slot.numel() < n || slot.type() != t) {
    slot = owned_tensor{};  // free the old one first
    slot = empty({std::max<std::int64_t>(n, 1)}, t);
  }
  return slot.reshape({slot.numel()}).narrow(0, 0, n).reshape(s);
}

// Checks the two layouts of an exchange: seq [B, T/cp, H, D] and heads [B, T, H/cp, D], sections
// summing to H, each divisible by cp.
void check_layouts(const tensor& seq, const tensor& heads, std::span<const std::int64_t> sections,
                   int cp, const char* what) {
  TROUPE_CHECK(seq.defined() && heads.defined() && seq.dim() == 4 && heads.dim() == 4 &&
                   seq.is_contiguous() && heads.is_contiguous() && seq.type() == heads.type(),
               "ulysses_exchange::", what, ": contiguous [B, T/cp, H, D] and [B, T, H/cp, D] ",
               "tensors of one dtype expected, got ", describe(seq), " and ", describe(heads));
  std::int64_t h = 0;
  for (auto s : sections) {
    TROUPE_CHECK(s > 0 && s % cp == 0, "ulysses_exchange::", what, ": a section of ", s,
                 " heads does not split over parallel.cp = ", cp, " ranks");
    h += s;
  }
  TROUPE_CHECK(seq.size(2) == h &&
                   heads.sizes() == shape({seq.size(0), seq.size(1) * cp, h / cp, seq.size(3)}),
               "ulysses_exchange::", what, ": ", describe(seq), " (sections of ", h,
               " heads) does not match ", describe(heads), " over ", cp, " ranks");
}

}  // namespace

ulysses_exchange::ulysses_exchange(collective::communicator& cp, std::shared_ptr<ulysses_pool> pool)
    : cp_(cp), pool_(std::move(pool)) {}

tensor ulysses_exchange::get(buffer which, const shape& s, dtype t) {
  switch (which) {
    case buffer::staging:
      return grown(pool_->staging, s, t);
    case buffer::att_heads:
      return grown(att_heads_, s, t);
    case buffer::rope_cos:
      return grown(pool_->rope_cos, s, t);
    case buffer::rope_sin:
      return grown(pool_->rope_sin, s, t);
    case buffer::kv_repeat:
      return grown(pool_->kv_repeat, s, t);
    case buffer::kv_heads:
      return grown(kv_heads_, s, t);
    case buffer::dkv_heads:
      return grown(pool_->dkv_heads, s, t);
  }
  TROUPE_FAIL("ulysses_exchange: unknown buffer");
}

void ulysses_exchange::keep(std::size_t slot, bool save) {
  if (kept_.size() <= slot) kept_.resize(slot + 1);
  // Saving and restoring are the same swap: the arena's buffers go where the stash's were.
  (void)save;
  std::swap(att_heads_, kept_[slot][0]);
  std::swap(kv_heads_, kept_[slot][1]);
}

void ulysses_exchange::to_heads(const tensor& x, const tensor& y,
                                std::span<const std::int64_t> sections) {
  const int cp = cp_.size();
  check_layouts(x, y, sections, cp, "to_heads");
  const std::int64_t b = x.size(0), tl = x.size(1), hl = y.size(2), d = x.size(3);
  const shape blocks{cp, b, tl, hl, d};
  const tensor send = grown(pool_->send, blocks, x.type());
  const tensor recv = grown(pool_->recv, blocks, x.type());
  // Block j (to rank j): this rank's positions of rank j's heads of every section.
  for (int j = 0; j < cp; ++j) {
    std::int64_t off = 0, local = 0;
    for (auto h : sections) {
      const std::int64_t part = h / cp;
      ops::copy(x.narrow(2, off + j * part, part), send.select(0, j).narrow(2, local, part));
      off += h;
      local += part;
    }
  }
  cp_.all_to_all(send.data(), recv.data(), static_cast<std::size_t>(b * tl * hl * d), x.type())
      .wait();
  // Block i (from rank i): rank i's positions of this rank's heads.
  for (int i = 0; i < cp; ++i) ops::copy(recv.select(0, i), y.narrow(1, i * tl, tl));
}

void ulysses_exchange::to_sequence(const tensor& x, const tensor& y,
                                   std::span<const std::int64_t> sections) {
  const int cp = cp_.size();
  check_layouts(y, x, sections, cp, "to_sequence");
  const std::int64_t b = y.size(0), tl = y.size(1), hl = x.size(2), d = x.size(3);
  const shape blocks{cp, b, tl, hl, d};
  const tensor send = grown(pool_->send, blocks, x.type());
  const tensor recv = grown(pool_->recv, blocks, x.type());
  for (int j = 0; j < cp; ++j) ops::copy(x.narrow(1, j * tl, tl), send.select(0, j));
  cp_.all_to_all(send.data(), recv.data(), static_cast<std::size_t>(b * tl * hl * d), x.type())
      .wait();
  for (int i = 0; i < cp; ++i) {
    std::int64_t off = 0, local = 0;
    for (auto h : sections) {
      const std::int64_t part = h / cp;
      ops::copy(recv.select(0, i).narrow(2, local, part), y.narrow(2, off + i * part, part));
      off += h;
      local += part;
    }
  }
}

cp_piece::cp_piece(const hf::model_config& model, std::int64_t rows, std::int64_t seq,
                   collective::communicator& cp, dtype t, bool recompute,
                   scheduler::cp_mode_kind mode)
    : cp_(cp), seq_(seq), pool_(std::make_shared<ulysses_pool>()) {
  const int n = cp.size();
  const bool ring = mode == scheduler::cp_mode_kind::ring;
  TROUPE_CHECK(n >= 1 && seq > 0 && seq % n == 0, "context parallelism: parallel.cp = ", n,
               " does not divide train.seq = ", seq, " (every rank holds seq / cp positions)");
  TROUPE_CHECK(!ring || seq % (2 * n) == 0, "context parallelism (ring): 2 x parallel.cp = ", 2 * n,
               " does not divide train.seq = ", seq,
               " (every rank holds two zigzag chunks of seq / (2 cp) positions)");
  TROUPE_CHECK(!std::holds_alternative<hf::moe_config>(model),
               "context parallelism (parallel.cp = ", n,
               ") is not available for mixture-of-experts models yet");
  local_seq_ = seq / n;
  model_ = with_family(model, [&](auto family, auto c) -> std::unique_ptr<causal_lm> {
    using F = typename decltype(family)::type;
    c.recompute = recompute;
    std::int64_t heads = c.n_head, kv = c.n_head;
    if constexpr (requires { c.n_kv_head; })
      if (c.n_kv_head > 0) kv = c.n_kv_head;
    TROUPE_CHECK(ring || (heads % n == 0 && (kv % n == 0 || n % kv == 0)),
                 "context parallelism (Ulysses): parallel.cp = ", n, " must divide the heads (",
                 heads, "), and divide the kv heads (", kv, ") or be a multiple of them");
    TROUPE_CHECK(seq <= c.max_seq, "context parallelism: train.seq = ", seq, " exceeds max_seq ",
                 c.max_seq);
    auto m = std::make_unique<causal_lm_of<typename F::model>>(c, batch_dims{rows, local_seq_}, t);
    if (ring) {
      ring_ = std::make_unique<ring_context>(cp, sequence_layout::zigzag);
      positions_ = empty({local_seq_}, dtype::i32);
      const auto pos = local_positions(seq, n, cp.rank(), sequence_layout::zigzag);
      for (std::int64_t i = 0; i < local_seq_; ++i)
        positions_.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(pos[i]);
      m->model().set_ring_context(positions_, ring_.get());
      return m;
    }
    for (std::int64_t i = 0; i < c.n_layer; ++i)
      exchanges_.push_back(std::make_unique<ulysses_exchange>(cp, pool_));
    m->model().set_context(cp.rank() * local_seq_,
                           [this](std::int64_t i) { return exchanges_.at(i).get(); });
    return m;
  });
  inner_ = std::make_unique<model_producer>(*model_);
  feed(*inner_, seq,
       sequence_pieces(seq, n, cp.rank(),
                       ring ? sequence_layout::zigzag : sequence_layout::contiguous));
}

cp_piece::~cp_piece() = default;

void cp_columns_piece::feed(grad_producer& inner, std::int64_t seq,
                            std::vector<sequence_piece> pieces) {
  inner_ = &inner;
  columns_ = std::make_unique<cp_columns>(seq, std::move(pieces));
}

double cp_columns_piece::forward_backward(int microbatches,
                                          const std::function<microbatch_data(int k)>& fetch) {
  TROUPE_CHECK(inner_ != nullptr, "context parallelism: a piece run before it was fed");
  return inner_->forward_backward(microbatches, [&](int k) { return (*columns_)(fetch(k), k); });
}

cp_columns::cp_columns(std::int64_t seq, std::vector<sequence_piece> pieces)
    : seq_(seq), pieces_(std::move(pieces)) {
  for (const auto& p : pieces_) local_ += p.length;
}

microbatch_data cp_columns::operator()(const microbatch_data& mb, int k) {
  constexpr std::int32_t ignore_index = -100;  // next_token_targets' (models/targets.hpp)
  const std::int64_t tl = local_;
  TROUPE_CHECK(mb.ids.dim() == 2 && mb.ids.size(1) == seq_ && mb.targets.sizes() == mb.ids.sizes(),
               "context parallelism: microbatch ", k, " must be [rows, ", seq_,
               "] ids and targets, got ", describe(mb.ids), " and ", describe(mb.targets));
  // Only ids and targets are cut into this rank's columns: packed rows' segments and positions
  // and per-token objectives (post-training) would be dropped silently, so they are refused here
  // as well as where the commands and dp_trainer refuse post-training under cp.
  TROUPE_CHECK(!mb.segments.defined() && !mb.positions.defined() && !mb.objective,
               "context parallelism (parallel.cp > 1): microbatch ", k,
               " carries packed rows or a token objective (post-training), which cp pieces do not ",
               "run yet");
  const std::int64_t rows = mb.ids.size(0);
  const auto* ids = mb.ids.data_as<std::int32_t>();
  const auto* targets = mb.targets.data_as<std::int32_t>();
  ids_.resize(static_cast<std::size_t>(rows * tl));
  targets_.resize(ids_.size());
  std::int64_t counted = 0, mine = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t i = 0; i < seq_; ++i) counted += targets[r * seq_ + i] != ignore_index;
    for (const auto& p : pieces_) {
      std::copy_n(ids + r * seq_ + p.start, p.length, ids_.begin() + r * tl + p.local);
      std::copy_n(targets + r * seq_ + p.start, p.length, targets_.begin() + r * tl + p.local);
    }
    for (std::int64_t i = 0; i < tl; ++i) mine += targets_[r * tl + i] != ignore_index;
  }
  microbatch_data out;
  out.ids = tensor(ids_.data(), ids_.size() * 4, dtype::i32, {rows, tl});
  out.targets = tensor(targets_.data(), targets_.size() * 4, dtype::i32, {rows, tl});
  out.weight =
      counted == 0 ? 0.0 : mb.weight * static_cast<double>(mine) / static_cast<double>(counted);
  return out;
}

}  // namespace troupe::models::parallel
