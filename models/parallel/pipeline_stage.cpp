// pipeline_stage: partition, per-microbatch activation stash and the checks shared by the GPT-2
// and Llama stages (see pipeline_stage.hpp).
#include "models/parallel/pipeline_stage.hpp"
#include "models/parallel/param_slices.hpp"

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "memory/error.hpp"
#include "scheduler/partition.hpp"

namespace troupe::models::parallel {

stage_options stage_options::of(const scheduler::parallel_plan& plan, int stage) {
  return {.stage = stage, .stages = plan.pp, .virtual_stages = plan.virtual_stages, .first = {}};
}

stage_options stage_options::of(const scheduler::parallel_plan& plan, int stage,
                                const scheduler::model_shape& m) {
  stage_options o = of(plan, stage);
  try {
    o.first = scheduler::partition_layers(plan.partition, m, plan.pp * plan.virtual_stages, plan.tp)
                  .first;
  } catch (const std::invalid_argument& e) {
    TROUPE_FAIL("parallel.partition = ", scheduler::name(plan.partition),
                " with parallel.pp = ", plan.pp,
                " x parallel.virtual_stages = ", plan.virtual_stages, ": ", e.what());
  }
  return o;
}

pipeline_stage::pipeline_stage(std::string what, std::int64_t n_layer, batch_dims dims,
                               const stage_options& o, tp_group tp, shape boundary)
    : what_(std::move(what)),
      dims_(dims),
      tp_(tp),
      stage_(o.stage),
      stages_(o.stages),
      chunks_(o.virtual_stages),
      boundary_(boundary),
      type_(o.type) {
  TROUPE_CHECK(o.type == dtype::f32 || o.type == dtype::bf16 || o.type == dtype::f16, what_,
               ": a pipeline stage computes in f32, bf16 or f16, not ", dtype_name(o.type));
  TROUPE_CHECK(o.stages >= 1 && o.stage >= 0 && o.stage < o.stages, what_, ": stage ", o.stage,
               " must be in [0, stages = ", o.stages, ")");
  TROUPE_CHECK(o.virtual_stages >= 1, what_, ": virtual_stages must be >= 1, got ",
               o.virtual_stages);
  TROUPE_CHECK(dims.batch > 0 && dims.seq > 0, what_, ": the planned microbatch [", dims.batch,
               ", ", dims.seq, "] must be positive");
  const int parts = o.stages * o.virtual_stages;
  TROUPE_CHECK(parts <= n_layer, what_, ": pp ", o.stages, " x virtual_stages ", o.virtual_stages,
               " = ", parts, " virtual stages need at least as many layers, but n_layer is ",
               n_layer, " (every virtual stage holds at least one block)");
  if (o.first.empty()) {
    scheduler::layer_costs costs;
    costs.layers.assign(static_cast<std::size_t>(n_layer), 1.0);
    first_ = scheduler::even_partition(costs, parts).first;
  } else {
    first_ = o.first;
    TROUPE_CHECK(static_cast<int>(first_.size()) == parts + 1 && first_.front() == 0 &&
                     first_.back() == n_layer,
                 what_, ": stage_options.first must have pp x virtual_stages + 1 = ", parts + 1,
                 " entries from 0 to n_layer = ", n_layer, ", got ", first_.size(), " entries");
    for (int k = 0; k < parts; ++k)
      TROUPE_CHECK(first_[k] < first_[k + 1], what_, ": stage_options.first: virtual stage ", k,
                   " holds no block ([", first_[k], ", ", first_[k + 1], "))");
  }
  chunk_.resize(static_cast<std::size_t>(chunks_));
  ids_ = empty({dims.batch, dims.seq}, dtype::i32);
  targets_ = empty({dims.batch, dims.seq}, dtype::i32);
}

std::int64_t pipeline_stage::first_block(int chunk) const {
  return first_[static_cast<std::size_t>(virtual_stage(chunk))];
}

std::int64_t pipeline_stage::end_block(int chunk) const {
  return first_[static_cast<std::size_t>(virtual_stage(chunk)) + 1];
}

void pipeline_stage::open_chunk(int chunk) {
  chunk_[chunk].slot_begin = slots_.slots().size();
}

void pipeline_stage::close_chunk(int chunk) {
  chunk_[chunk].slot_end = slots_.slots().size();
}

void pipeline_stage::plan_memory() {
  mem_ = layer_memory(slots_, type_, device::cpu());
  const auto& all = slots_.slots();
  std::vector<char> owned(all.size(), 0);
  if (recompute_) rerun_out_ = empty(boundary_, type_);
  std::size_t tmp_bytes = 0;
  for (int c = 0; c < chunks_; ++c) {
    auto& ch = chunk_[c];
    for (std::size_t i = ch.slot_begin; i < ch.slot_end; ++i) {
      owned[i] = 1;
      if (all[i].kind != slot_kind::activation || recompute_) continue;
      ch.state.push_back(*all[i].field);
    }
    if (!recompute_) tmp_bytes = std::max(tmp_bytes, swap_activation_pages(c));
    if (recompute_ && !holds_first(c)) {
      ch.input = empty(boundary_, type_);
      ch.state.push_back(ch.input);
    }
    ch.segments = empty({dims_.batch, dims_.seq}, dtype::i32);
    ch.positions = empty({dims_.batch, dims_.seq}, dtype::i32);
    if (holds_first(c)) ch.state.push_back(ids_);
    if (holds_last(c)) ch.state.push_back(targets_);
    for (const auto& t : ch.state) ch.bytes += t.nbytes();
  }
  for (std::size_t i = 0; i < all.size(); ++i)
    TROUPE_CHECK(owned[i] || all[i].kind != slot_kind::activation, what_, ": activation '",
                 all[i].name,
                 "' belongs to no chunk (declare it between open_chunk and close_chunk)");
  if (tmp_bytes > 0) swap_tmp_ = mapped_pages(tmp_bytes);
}

std::size_t pipeline_stage::swap_activation_pages(int chunk) {
  auto& ch = chunk_[chunk];
  // A tensor shard's activations are the tp collectives' buffers (SP all-gathers, row-parallel
  // reductions): a transport may have registered their pages (UCX's rcache), and the swap bypasses
  // UCX's mremap hook (page_swap.hpp), so a shard copies its stash.
  if (ch.state.empty() || tp_.size() > 1) return 0;
  auto* lo = static_cast<std::byte*>(ch.state.front().data());
  std::byte* hi = lo;
  for (const auto& t : ch.state) {
    lo = std::min(lo, static_cast<std::byte*>(t.data()));
    hi = std::max(hi, static_cast<std::byte*>(t.data()) + t.nbytes());
  }
  // Only when no other chunk's activation lies in between (the arena is laid out in declaration
  // order, so each chunk's activations are one range) and the range holds enough whole pages.
  for (std::size_t i = 0; i < slots_.slots().size(); ++i) {
    const auto& x = slots_.slots()[i];
    if (x.kind != slot_kind::activation || (i >= ch.slot_begin && i < ch.slot_end)) continue;
    auto* p = static_cast<std::byte*>(x.field->data());
    if (p < hi && p + x.field->nbytes() > lo) return 0;
  }
  const auto pg = static_cast<std::uintptr_t>(page_size());
  const auto a = (reinterpret_cast<std::uintptr_t>(lo) + pg - 1) / pg * pg;
  const auto b = reinterpret_cast<std::uintptr_t>(hi) / pg * pg;
  if (b < a + 16 * pg) return 0;  // under 64 KiB a copy costs next to nothing
  ch.page_lo = reinterpret_cast<std::byte*>(a);
  ch.page_bytes = b - a;
  // What is still copied: the bytes before and after the whole pages.
  ch.state.clear();
  auto edge = [&](std::byte* from, std::byte* to) {
    if (to > from) {
      const auto n = static_cast<std::size_t>(to - from);
      ch.state.emplace_back(from, n, dtype::u8, shape{static_cast<std::int64_t>(n)});
    }
  };
  edge(lo, ch.page_lo);
  edge(ch.page_lo + ch.page_bytes, hi);
  return ch.page_bytes;
}

void pipeline_stage::move_pages(int chunk, std::size_t slot, bool to_arena) {
  auto& ch = chunk_[chunk];
  if (ch.page_bytes == 0) return;
  if (ch.pages.size() <= slot) ch.pages.resize(slot + 1);
  if (ch.pages[slot].data() == nullptr) ch.pages[slot] = mapped_pages(ch.page_bytes);
  void* arena = ch.page_lo;
  void* kept = ch.pages[slot].data();
  // A swap: the arena's pages go to the slot and the slot's to the arena, whichever way the
  // bytes are meant to move (the other side's old bytes are dead either way).
  if (!swap_off_) {
    bool swapped = false;
    try {
      swapped = swap_pages(arena, kept, swap_tmp_.data(), ch.page_bytes);
    } catch (const std::exception& e) {
      // Half a swap: a microbatch's activations are lost; this stage cannot run another step.
      broken_ = e.what();
      throw;
    }
    if (swapped) {
      ++page_swaps_;
      return;
    }
    swap_off_ = true;  // the kernel refuses the move (valgrind, an old kernel): copy from now on
  }
  if (to_arena)
    std::memcpy(arena, kept, ch.page_bytes);
  else
    std::memcpy(kept, arena, ch.page_bytes);
}

void pipeline_stage::set_context(const stage_context&) {
  TROUPE_FAIL(what_, " (stage ", stage_, "): this stage cannot run context parallelism");
}

void pipeline_stage::begin_step(int microbatches) {
  TROUPE_CHECK(broken_.empty(), what_, ": a stash of an earlier step failed half way (", broken_,
               "); this stage cannot run another step");
  TROUPE_CHECK(microbatches >= 1, what_, ": microbatches must be >= 1, got ", microbatches);
  microbatches_ = microbatches;
  pending_.assign(static_cast<std::size_t>(chunks_ * microbatches), 0);
  weight_.assign(static_cast<std::size_t>(microbatches), 0.0);
  queue_of_.assign(pending_.size(), -1);
  free_queues_.clear();
  for (int k = static_cast<int>(queues_.size()) - 1; k >= 0; --k) {
    queues_[static_cast<std::size_t>(k)].clear();
    free_queues_.push_back(k);
  }
  for (auto& ch : chunk_) {
    ch.stashed.assign(static_cast<std::size_t>(microbatches), -1);
    ch.live = -1;
    ch.free.clear();
    for (std::size_t k = 0; k < ch.pool.size(); ++k) ch.free.push_back(k);
  }
}

void pipeline_stage::set_generation_shape(std::int64_t n_kv_head, std::int64_t head_dim,
                                          std::int64_t vocab, std::int64_t max_seq) {
  gen_shape_.n_layer = 0;  // the blocks held
  for (int c = 0; c < chunks_; ++c) gen_shape_.n_layer += end_block(c) - first_block(c);
  gen_shape_.n_kv_head = n_kv_head;
  gen_shape_.head_dim = head_dim;
  gen_shape_.vocab = vocab;
  gen_shape_.rows = boundary_[1];
  gen_shape_.max_batch = dims_.batch;
  gen_shape_.max_step = dims_.seq;
  gen_shape_.max_seq = max_seq;
}

void pipeline_stage::apply_packing(int chunk) {
  auto& ch = chunk_[chunk];
  TROUPE_CHECK(ch.packed ? use_packing(chunk, ch.segments, ch.positions)
                         : use_packing(chunk, tensor{}, tensor{}),
               what_, " (stage ", stage_, "): this model cannot run packed rows (segments)");
}

void pipeline_stage::begin_generation(std::int64_t batch, std::int64_t capacity) {
  TROUPE_CHECK(gen_shape_.n_layer > 0, what_, ": generation is not set up for this model");
  TROUPE_CHECK(type_ == dtype::f32, what_, ": generation through pipeline stages runs in f32 ",
               "only, this stage computes in ", dtype_name(type_));
  TROUPE_CHECK(in_flight() == 0, what_, ": generation cannot begin with ", in_flight(),
               " microbatches of a step in flight");
  for (int c = 0; c < chunks_; ++c) {  // a generation step runs whole sequences
    chunk_[c].packed = false;
    apply_packing(c);
  }
  tp_generation_plan p = gen_shape_;
  p.batch = batch;
  p.capacity = capacity;
  begin_tp_generation(gen_, p, tp_, what_);
}

tp_generation& pipeline_stage::generation() {
  TROUPE_CHECK(gen_ != nullptr, what_, ": a generation step before begin_generation");
  TROUPE_CHECK(in_flight() == 0, what_, ": a generation step with ", in_flight(),
               " microbatches of a training step in flight");
  return *gen_;
}

const kv_layer& pipeline_stage::cached(std::int64_t block) const {
  TROUPE_CHECK(gen_ != nullptr, what_, ": a generation step before begin_generation");
  std::int64_t k = 0;  // the caches follow the held blocks in chunk order
  for (int c = 0; c < chunks_; ++c) {
    if (block >= first_block(c) && block < end_block(c))
      return gen_->layer(k + block - first_block(c));
    k += end_block(c) - first_block(c);
  }
  TROUPE_FAIL(what_, ": block ", block, " is not held by stage ", stage_);
}

int pipeline_stage::in_flight() const {
  int n = 0;
  for (char p : pending_) n += p != 0;
  return n;
}

std::size_t pipeline_stage::weight_queue_bytes() const {
  std::size_t n = 0;
  for (const auto& q : queues_) n += q.buffer_bytes();
  return n;
}

std::size_t pipeline_stage::stash_buffers() const {
  std::size_t n = 0;
  for (const auto& ch : chunk_) n += ch.pool.size();
  return n;
}

std::size_t pipeline_stage::stash_bytes() const {
  std::size_t n = 0;
  for (const auto& ch : chunk_) n += ch.pool.size() * (ch.bytes + ch.page_bytes);
  return n;
}

bool pipeline_stage::counts_in_norm(const tensor_slot& parameter) const {
  if (stages_ > 1 && stage_ != 0 && !tied_name_.empty() && parameter.name == tied_name_)
    return false;
  // Replicated parameters (declared so: param_spec) are counted on tensor rank 0 only.
  if (tp_.size() > 1 && tp_.rank() != 0 && replicated_over_tp(parameter)) return false;
  return true;
}

void pipeline_stage::check_mb(int mb, int chunk, const char* op) const {
  TROUPE_CHECK(microbatches_ > 0, what_, ": ", op, " before begin_step");
  TROUPE_CHECK(chunk >= 0 && chunk < chunks_, what_, " (stage ", stage_, "): ", op, " of chunk ",
               chunk, " but the stage has ", chunks_, " chunks");
  TROUPE_CHECK(mb >= 0 && mb < microbatches_, what_, " (stage ", stage_, "): ", op,
               " of microbatch ", mb, " but the step has ", microbatches_);
}

void pipeline_stage::stash(int chunk, int mb) {
  auto& ch = chunk_[chunk];
  std::size_t slot;
  if (!ch.free.empty()) {
    slot = ch.free.back();
    ch.free.pop_back();
  } else {
    slot = ch.pool.size();
    ch.pool.push_back(empty({static_cast<std::int64_t>(ch.bytes)}, dtype::u8));
  }
  auto* dst = static_cast<std::byte*>(ch.pool[slot].data());
  for (const auto& t : ch.state) {
    std::memcpy(dst, t.data(), t.nbytes());
    dst += t.nbytes();
  }
  move_pages(chunk, slot, /*to_arena=*/false);
  // The packed rows, only when the microbatch has them (pretraining's stashes copy nothing more).
  if (ch.packed_saved.size() <= slot) ch.packed_saved.resize(slot + 1);
  ch.packed_saved[slot] = ch.packed;
  if (ch.packed) {
    if (ch.packing_saved.size() <= slot) ch.packing_saved.resize(slot + 1);
    auto& kept = ch.packing_saved[slot];
    if (!kept.defined()) kept = empty({2 * ch.segments.numel()}, dtype::i32);
    std::memcpy(kept.data(), ch.segments.data(), ch.segments.nbytes());
    std::memcpy(static_cast<std::byte*>(kept.data()) + ch.segments.nbytes(), ch.positions.data(),
                ch.positions.nbytes());
  }
  save_extra(chunk, slot);
  ch.stashed[mb] = static_cast<int>(slot);
}

void pipeline_stage::restore(int chunk, int mb) {
  auto& ch = chunk_[chunk];
  int slot = ch.stashed[mb];
  TROUPE_CHECK(slot >= 0, what_, " (stage ", stage_, "): the activations of microbatch ", mb,
               " chunk ", chunk, " were not kept");
  const auto* src = static_cast<const std::byte*>(ch.pool[slot].data());
  for (const auto& t : ch.state) {
    std::memcpy(t.data(), src, t.nbytes());
    src += t.nbytes();
  }
  move_pages(chunk, static_cast<std::size_t>(slot), /*to_arena=*/true);
  restore_extra(chunk, static_cast<std::size_t>(slot));
  const bool packed = ch.packed_saved[static_cast<std::size_t>(slot)] != 0;
  if (packed) {
    const auto* kept =
        static_cast<const std::byte*>(ch.packing_saved[static_cast<std::size_t>(slot)].data());
    std::memcpy(ch.segments.data(), kept, ch.segments.nbytes());
    std::memcpy(ch.positions.data(), kept + ch.segments.nbytes(), ch.positions.nbytes());
  }
  if (packed || ch.packed) {  // the chunk's blocks read the restored microbatch's (or none)
    ch.packed = packed;
    apply_packing(chunk);
  }
  ch.stashed[mb] = -1;
  ch.free.push_back(static_cast<std::size_t>(slot));
}

namespace {

void check_tokens(const tensor& t, batch_dims d, const std::string& what, int stage, int mb,
                  const char* name) {
  const shape want{d.batch, d.seq};
  TROUPE_CHECK(
      t.defined() && t.type() == dtype::i32 && t.is_cpu() && t.is_contiguous() && t.sizes() == want,
      what, " (stage ", stage, "): microbatch ", mb, " ", name, " must be i32 [", d.batch, ", ",
      d.seq, "] on the host (the planned microbatch; every microbatch of ",
      "a pipeline has that shape), got ", describe(t));
}

void check_boundary(const tensor& t, const shape& s, dtype type, const std::string& what, int stage,
                    int mb, const char* name) {
  TROUPE_CHECK(t.defined() && t.type() == type && t.is_cpu() && t.is_contiguous() && t.sizes() == s,
               what, " (stage ", stage, "): microbatch ", mb, " ", name, " must be ",
               dtype_name(type), " ", s.str(), " on the host, got ", describe(t));
}

}  // namespace

double pipeline_stage::forward(int mb, int chunk, const tensor& in, const tensor& targets,
                               double weight, const tensor& y) {
  check_mb(mb, chunk, "forward");
  auto& ch = chunk_[chunk];
  auto& pend = pending_[static_cast<std::size_t>(chunk * microbatches_ + mb)];
  TROUPE_CHECK(!pend, what_, " (stage ", stage_, "): forward of microbatch ", mb, " chunk ", chunk,
               " ran twice before its backward");
  if (holds_first(chunk))
    check_tokens(in, dims_, what_, stage_, mb, "ids");
  else
    check_boundary(in, boundary_, type_, what_, stage_, mb, "input activation");
  if (holds_last(chunk))
    check_tokens(targets, dims_, what_, stage_, mb, "targets");
  else
    check_boundary(y, boundary_, type_, what_, stage_, mb, "output activation");
  if (ch.live >= 0) stash(chunk, ch.live);  // keep the arena's microbatch for its backward
  if (holds_first(chunk)) std::memcpy(ids_.data(), in.data(), ids_.nbytes());
  if (holds_last(chunk)) {
    std::memcpy(targets_.data(), targets.data(), targets_.nbytes());
    weight_[mb] = weight;
    // After the stash above: the previous microbatch keeps its own objective.
    const bool wanted = static_cast<bool>(next_objective_);
    TROUPE_CHECK(use_objective(std::move(next_objective_)) || !wanted, what_, " (stage ", stage_,
                 "): this stage's head cannot train a per-token objective");
    next_objective_ = {};
  }
  {
    // After the stash above: the previous microbatch keeps its own packed rows.
    const tensor seg = std::move(next_segments_), pos = std::move(next_positions_);
    next_segments_ = next_positions_ = tensor{};
    TROUPE_CHECK(seg.defined() == pos.defined(), what_, " (stage ", stage_, "): microbatch ", mb,
                 ": packed rows need both segments and positions, or neither");
    const bool was = ch.packed;
    ch.packed = seg.defined();
    if (ch.packed) {
      check_tokens(seg, dims_, what_, stage_, mb, "segments");
      check_tokens(pos, dims_, what_, stage_, mb, "positions");
      std::memcpy(ch.segments.data(), seg.data(), ch.segments.nbytes());
      std::memcpy(ch.positions.data(), pos.data(), ch.positions.nbytes());
    }
    if (ch.packed || was) apply_packing(chunk);
  }
  ch.live = mb;
  pend = 1;
  if (holds_first(chunk)) return run_forward(chunk, ids_, targets_, y);
  if (!recompute_) return run_forward(chunk, in, targets_, y);
  std::memcpy(ch.input.data(), in.data(), ch.input.nbytes());  // the stash keeps this only
  return run_forward(chunk, ch.input, targets_, y);
}

void pipeline_stage::next_objective(token_objective f) {
  next_objective_ = std::move(f);
}

void pipeline_stage::next_packing(const tensor& segments, const tensor& positions) {
  next_segments_ = segments;
  next_positions_ = positions;
}

void pipeline_stage::rerun(int chunk) {
  const auto& ch = chunk_[chunk];
  run_forward(chunk, holds_first(chunk) ? ids_.view() : ch.input.view(), targets_,
              holds_last(chunk) ? tensor{} : rerun_out_.view());
  ++recomputed_;
}

void pipeline_stage::backward(int mb, int chunk, const tensor& dy, const tensor& dx,
                              const block_hook& after_block, bool split) {
  check_mb(mb, chunk, "backward");
  auto& ch = chunk_[chunk];
  const auto at = static_cast<std::size_t>(chunk * microbatches_ + mb);
  auto& pend = pending_[at];
  TROUPE_CHECK(pend == 1, what_, " (stage ", stage_, "): backward of microbatch ", mb, " chunk ",
               chunk, pend == 2 ? " ran twice" : " without its forward");
  if (!holds_last(chunk))
    check_boundary(dy, boundary_, type_, what_, stage_, mb, "output gradient");
  if (!holds_first(chunk))
    check_boundary(dx, boundary_, type_, what_, stage_, mb, "input gradient");
  if (ch.live != mb) {
    if (ch.live >= 0) stash(chunk, ch.live);
    restore(chunk, mb);
    ch.live = mb;
    if (recompute_) rerun(chunk);
  }
  if (!split) {
    run_backward(chunk, dy, dx, weight_[mb], after_block);
  } else {
    if (free_queues_.empty()) {
      free_queues_.push_back(static_cast<int>(queues_.size()));
      queues_.emplace_back();
    }
    const int k = free_queues_.back();
    auto& q = queues_[static_cast<std::size_t>(k)];
    q.clear();  // what a backward that threw left
    {
      deferred_weight_grads::scope in(q);
      run_backward(chunk, dy, dx, weight_[mb], [&q](std::int64_t block) { q.mark(block); });
    }
    free_queues_.pop_back();
    queue_of_[at] = k;
  }
  ch.live = -1;  // backward may overwrite what it read (the logits hold dlogits)
  pend = split ? 2 : 0;
}

void pipeline_stage::weight(int mb, int chunk, const block_hook& after_block) {
  check_mb(mb, chunk, "weight");
  const auto at = static_cast<std::size_t>(chunk * microbatches_ + mb);
  TROUPE_CHECK(pending_[at] == 2, what_, " (stage ", stage_, "): weight pass of microbatch ", mb,
               " chunk ", chunk, " without a split backward before it");
  const int k = queue_of_[at];
  queues_[static_cast<std::size_t>(k)].run(after_block);
  queue_of_[at] = -1;
  free_queues_.push_back(k);
  pending_[at] = 0;
}

}  // namespace troupe::models::parallel
