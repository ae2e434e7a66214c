#include "models/layers/ring_attention.hpp"

#include <chrono>
#include <string>

#include "memory/error.hpp"
#include "tensor/attention_merge.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

// A contiguous [sizes] tensor over the start of `storage`, offset by `elems` elements.
tensor carve(const tensor& storage, std::int64_t elems, const shape& sizes) {
  auto* base =
      static_cast<char*>(storage.data()) + static_cast<std::size_t>(elems) * storage.element_size();
  const std::size_t cap =
      storage.nbytes() - static_cast<std::size_t>(elems) * storage.element_size();
  return tensor(base, cap, storage.type(), sizes, storage.dev());
}

// into += x, both [B, n, H, D] views with contiguous [H, D] rows: x is the op's own buffer (each
// sequence's rows contiguous); `into` may be a view of a fused buffer (dq of a fused dqkv), whose
// rows are then added one token at a time.
void accumulate(const tensor& x, const tensor& into) {
  for (std::int64_t b = 0; b < x.size(0); ++b) {
    const tensor xb = x.select(0, b), ib = into.select(0, b);
    if (ib.is_contiguous()) {
      ops::axpy(1.0, xb, ib);
      continue;
    }
    for (std::int64_t t = 0; t < xb.size(0); ++t) ops::axpy(1.0, xb.select(0, t), ib.select(0, t));
  }
}

// Waits for w (when issued), adding the time blocked to `waited`.
void await(collective::work& w, double& waited) {
  if (!w.valid()) return;
  const auto t0 = std::chrono::steady_clock::now();
  w.wait();
  waited += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void check_like(const char* what, const tensor& t, const shape& want, dtype type) {
  TROUPE_CHECK(t.defined() && t.sizes() == want && t.type() == type, "ring_attention: ", what,
               " must be ", dtype_name(type), want.str(), ", got ",
               t.defined() ? t.describe() : std::string("nothing"));
  TROUPE_CHECK(t.is_cpu(), "ring_attention: ", what,
               " must be on the host (attention_merge has no CUDA kernel yet), got ", t.describe());
}

void check_rows(const char* what, const tensor& t) {
  TROUPE_CHECK(t.size(3) <= 1 || t.stride(3) == 1, "ring_attention: ", what,
               " needs a contiguous last dimension, got ", t.describe());
  TROUPE_CHECK(t.size(2) <= 1 || t.stride(2) == t.size(3), "ring_attention: ", what,
               " needs the heads of a token contiguous, got ", t.describe());
}

}  // namespace

ring_attention::ring_attention(collective::communicator& cp, const ring_attention_config& cfg)
    : comm_(cp), cfg_(cfg), rank_(cp.rank()), size_(cp.size()) {
  if (cfg_.n_kv_head == 0) cfg_.n_kv_head = cfg_.n_head;
  const auto& c = cfg_;
  TROUPE_CHECK(c.batch > 0 && c.local_seq > 0 && c.n_head > 0 && c.head_dim > 0,
               "ring_attention: batch, local_seq, n_head and head_dim must be positive, got ",
               c.batch, ", ", c.local_seq, ", ", c.n_head, ", ", c.head_dim);
  TROUPE_CHECK(c.n_kv_head > 0 && c.n_head % c.n_kv_head == 0, "ring_attention: n_head (", c.n_head,
               ") must be a multiple of n_kv_head (", c.n_kv_head, ")");
  narrow_ = c.type == dtype::bf16 || c.type == dtype::f16;
  wide_ = narrow_ ? dtype::f32 : c.type;
  TROUPE_CHECK(c.type == dtype::f32 || c.type == dtype::f64 || narrow_,
               "ring_attention: type must be f32, f64, bf16 or f16, got ", dtype_name(c.type));
  TROUPE_CHECK(c.layout != sequence_layout::zigzag || c.local_seq % 2 == 0,
               "ring_attention: the zigzag layout needs an even local_seq (two chunks), got ",
               c.local_seq);
  half_ = c.local_seq / 2;
  if (size_ == 1) return;  // the plain kernel on the whole sequence: no workspace
  const shape kv{2, c.batch, c.local_seq, c.n_kv_head, c.head_dim};
  const shape qs{c.batch, c.local_seq, c.n_head, c.head_dim};
  for (auto& b : kv_) b = empty(kv, c.type);  // the blocks travel in the op's type
  part_out_ = empty(qs, wide_);
  part_lse_ = empty({c.batch, c.n_head, c.local_seq}, wide_);
  for (auto& b : dkv_) b = empty(kv, wide_);  // the accumulators in the statistics' type
  dkv_part_ = empty(kv, wide_);
  if (c.layout == sequence_layout::zigzag)
    for (auto& b : lse_half_) b = empty({c.batch, c.n_head, half_}, wide_);
  if (narrow_) {
    kv_wide_ = empty(kv, wide_);
    lse_wide_ = empty({c.batch, c.n_head, c.local_seq}, wide_);
    for (auto* b : {&q_wide_, &out_wide_, &dout_wide_, &dq_wide_}) *b = empty(qs, wide_);
  }
}

std::size_t ring_attention::workspace_bytes() const {
  std::size_t n = part_out_.nbytes() + part_lse_.nbytes() + dkv_part_.nbytes();
  for (int i = 0; i < 2; ++i) n += kv_[i].nbytes() + dkv_[i].nbytes() + lse_half_[i].nbytes();
  for (const auto* b : {&kv_wide_, &lse_wide_, &q_wide_, &out_wide_, &dout_wide_, &dq_wide_})
    if (b->defined()) n += b->nbytes();
  return n;
}

ring_attention::visibility ring_attention::block_visibility(int owner) const {
  if (!cfg_.causal) return visibility::full;
  if (owner == rank_) return visibility::causal;
  if (cfg_.layout == sequence_layout::contiguous)
    return owner < rank_ ? visibility::full : visibility::hidden;
  return owner < rank_ ? visibility::all_see_first_half : visibility::second_half_sees_all;
}

void ring_attention::pack_kv(const tensor& k, const tensor& v, const tensor& kv) const {
  ops::copy(k, kv.select(0, 0));
  ops::copy(v, kv.select(0, 1));
}
tensor ring_attention::k_of(const tensor& kv) const {
  return kv.select(0, 0);
}
tensor ring_attention::v_of(const tensor& kv) const {
  return kv.select(0, 1);
}

void ring_attention::forward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                             const tensor& lse) {
  const auto& c = cfg_;
  const shape qs{c.batch, c.local_seq, c.n_head, c.head_dim};
  const shape ks{c.batch, c.local_seq, c.n_kv_head, c.head_dim};
  check_like("q", q, qs, c.type);
  check_like("k", k, ks, c.type);
  check_like("v", v, ks, c.type);
  check_like("out", out, qs, c.type);
  check_like("lse", lse, {c.batch, c.n_head, c.local_seq},
             narrow_ && lse.type() == c.type ? c.type : wide_);
  ops::attention_options causal{c.scale, c.causal, {}}, full{c.scale, false, {}};
  waited_.forward = 0;
  if (size_ == 1) return ops::attention(q, k, v, out, lse, causal);
  // 16-bit: computed from f32 copies into an f32 running output, rounded into out at the end.
  const tensor qw = narrow_ ? q_wide_.view() : q, ow = narrow_ ? out_wide_.view() : out;
  // The running log-sum-exp in f32 too, whatever the caller keeps (a 16-bit layer's is 16-bit).
  const tensor lw = lse.type() != wide_ ? lse_wide_.view() : lse;
  if (narrow_) ops::copy(q, qw);

  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const std::size_t kv_count = static_cast<std::size_t>(kv_[0].numel());
  const std::int64_t h = half_;
  const shape half_lse{c.batch, c.n_head, h};
  const tensor plse_lo = carve(part_lse_, 0, half_lse);
  const tensor plse_hi = carve(part_lse_, c.batch * c.n_head * h, half_lse);
  pack_kv(k, v, kv_[0]);
  for (int s = 0; s < size_; ++s) {
    const tensor& cur = kv_[s % 2];
    const tensor& nxt = kv_[(s + 1) % 2];
    collective::work got, sent;
    if (s + 1 < size_) {  // the next block arrives while this one is computed
      got = comm_.recv(nxt.data(), kv_count, c.type, prev);
      sent = comm_.send(cur.data(), kv_count, c.type, next);
    }
    if (narrow_) ops::copy(cur, kv_wide_);
    const tensor& blk = narrow_ ? kv_wide_.view() : cur;
    const tensor kb = k_of(blk), vb = v_of(blk);
    switch (block_visibility((rank_ - s + size_) % size_)) {
      case visibility::causal:  // s == 0: the first block writes out and lse whole
        ops::attention(qw, kb, vb, ow, lw, causal);
        break;
      case visibility::full:
        if (s == 0) {
          ops::attention(qw, kb, vb, ow, lw, full);
        } else {
          ops::attention(qw, kb, vb, part_out_, part_lse_, full);
          ops::attention_merge(ow, lw, part_out_, part_lse_);
        }
        break;
      case visibility::all_see_first_half: {
        const tensor k1 = kb.narrow(1, 0, h), v1 = vb.narrow(1, 0, h);
        const tensor po_lo = part_out_.narrow(1, 0, h), po_hi = part_out_.narrow(1, h, h);
        ops::attention(qw.narrow(1, 0, h), k1, v1, po_lo, plse_lo, full);
        ops::attention(qw.narrow(1, h, h), k1, v1, po_hi, plse_hi, full);
        ops::attention_merge(ow.narrow(1, 0, h), lw.narrow(2, 0, h), po_lo, plse_lo);
        ops::attention_merge(ow.narrow(1, h, h), lw.narrow(2, h, h), po_hi, plse_hi);
        break;
      }
      case visibility::second_half_sees_all: {
        const tensor po_hi = part_out_.narrow(1, h, h);
        ops::attention(qw.narrow(1, h, h), kb, vb, po_hi, plse_lo, full);
        ops::attention_merge(ow.narrow(1, h, h), lw.narrow(2, h, h), po_hi, plse_lo);
        break;
      }
      case visibility::hidden:
        break;
    }
    await(got, waited_.forward);
    await(sent, waited_.forward);
  }
  if (narrow_) ops::copy(ow, out);  // the one rounding of the output (and of the lse)
  if (lw.data() != lse.data()) ops::copy(lw, lse);
}

void ring_attention::backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                              const tensor& lse, const tensor& dout, const tensor& dq,
                              const tensor& dk, const tensor& dv) {
  const auto& c = cfg_;
  const shape qs{c.batch, c.local_seq, c.n_head, c.head_dim};
  const shape ks{c.batch, c.local_seq, c.n_kv_head, c.head_dim};
  check_like("q", q, qs, c.type);
  check_like("k", k, ks, c.type);
  check_like("v", v, ks, c.type);
  check_like("out", out, qs, c.type);
  check_like("lse", lse, {c.batch, c.n_head, c.local_seq},
             narrow_ && lse.type() == c.type ? c.type : wide_);
  check_like("dout", dout, qs, c.type);
  check_like("dq", dq, qs, c.type);
  check_like("dk", dk, ks, c.type);
  check_like("dv", dv, ks, c.type);
  ops::attention_options causal{c.scale, c.causal, {}}, full{c.scale, false, {}};
  waited_.backward = 0;
  if (size_ == 1) return ops::attention_backward(q, k, v, out, dout, lse, dq, dk, dv, causal);
  // 16-bit: every block's share computed from f32 copies of q, out and dout, dq accumulated in
  // f32 (the dk/dv accumulators are f32 already), each gradient rounded once at the end.
  const tensor qw = narrow_ ? q_wide_.view() : q, ow = narrow_ ? out_wide_.view() : out;
  const tensor dow = narrow_ ? dout_wide_.view() : dout, dqw = narrow_ ? dq_wide_.view() : dq;
  const tensor lw = lse.type() != wide_ ? lse_wide_.view() : lse;
  if (lw.data() != lse.data()) ops::copy(lse, lw);
  if (narrow_) {
    ops::copy(q, qw);
    ops::copy(out, ow);
    ops::copy(dout, dow);
  } else {
    check_rows("dq", dq);
  }

  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const std::size_t kv_count = static_cast<std::size_t>(kv_[0].numel());
  const std::int64_t h = half_;
  const bool zigzag = c.layout == sequence_layout::zigzag;
  if (zigzag) {
    ops::copy(lw.narrow(2, 0, h), lse_half_[0]);
    ops::copy(lw.narrow(2, h, h), lse_half_[1]);
  }
  const tensor dq_share = part_out_;  // a block's share of dq
  const tensor dk_share = k_of(dkv_part_), dv_share = v_of(dkv_part_);
  pack_kv(k, v, kv_[0]);
  // Sends to `next` go in the order kv block s, dk/dv of block s; receives from `prev` in the
  // order dk/dv of block s - 1, kv block s + 1: the same sequence on both ends of each link.
  collective::work acc_sent[2];
  for (int s = 0; s < size_; ++s) {
    const tensor& cur = kv_[s % 2];
    const tensor& nxt = kv_[(s + 1) % 2];
    const tensor& acc = dkv_[s % 2];
    collective::work acc_got, got, sent;
    if (s > 0) {
      await(acc_sent[s % 2], waited_.backward);  // its send of step s - 2
      acc_got = comm_.recv(acc.data(), kv_count, wide_, prev);
    }
    if (s + 1 < size_) {
      got = comm_.recv(nxt.data(), kv_count, c.type, prev);
      sent = comm_.send(cur.data(), kv_count, c.type, next);
    }
    if (narrow_) ops::copy(cur, kv_wide_);
    const tensor& blk = narrow_ ? kv_wide_.view() : cur;
    const tensor kb = k_of(blk), vb = v_of(blk);
    const visibility vis = block_visibility((rank_ - s + size_) % size_);
    if (s == 0) {  // the own block: dq and this block's accumulator start here
      ops::attention_backward(qw, kb, vb, ow, dow, lw, dqw, k_of(acc), v_of(acc),
                              vis == visibility::causal ? causal : full);
    } else {
      switch (vis) {
        case visibility::causal:  // only the own block, at s == 0
        case visibility::hidden:
          break;
        case visibility::full:
          ops::attention_backward(qw, kb, vb, ow, dow, lw, dq_share, dk_share, dv_share, full);
          accumulate(dq_share, dqw);
          break;
        case visibility::all_see_first_half: {
          const tensor k1 = kb.narrow(1, 0, h), v1 = vb.narrow(1, 0, h);
          for (int part = 0; part < 2; ++part) {  // each local chunk against the block's first
            const std::int64_t at = part * h;
            ops::attention_backward(qw.narrow(1, at, h), k1, v1, ow.narrow(1, at, h),
                                    dow.narrow(1, at, h), lse_half_[part],
                                    dq_share.narrow(1, at, h), dk_share.narrow(1, at, h),
                                    dv_share.narrow(1, at, h), full);
          }
          accumulate(dq_share, dqw);
          break;
        }
        case visibility::second_half_sees_all:
          ops::attention_backward(qw.narrow(1, h, h), kb, vb, ow.narrow(1, h, h),
                                  dow.narrow(1, h, h), lse_half_[1], dq_share.narrow(1, h, h),
                                  dk_share, dv_share, full);
          accumulate(dq_share.narrow(1, h, h), dqw.narrow(1, h, h));
          break;
      }
      await(acc_got, waited_.backward);
      switch (vis) {
        case visibility::full:
        case visibility::second_half_sees_all:
          ops::add(acc, dkv_part_, acc);
          break;
        case visibility::all_see_first_half:
          // Both local chunks' shares land on the block's first chunk; its second saw no query.
          accumulate(dk_share.narrow(1, 0, h), k_of(acc).narrow(1, 0, h));
          accumulate(dk_share.narrow(1, h, h), k_of(acc).narrow(1, 0, h));
          accumulate(dv_share.narrow(1, 0, h), v_of(acc).narrow(1, 0, h));
          accumulate(dv_share.narrow(1, h, h), v_of(acc).narrow(1, 0, h));
          break;
        case visibility::causal:
        case visibility::hidden:
          break;
      }
    }
    acc_sent[s % 2] = comm_.send(acc.data(), kv_count, wide_, next);
    await(got, waited_.backward);
    await(sent, waited_.backward);
  }
  // The own block's accumulator comes home from prev after its round.
  const tensor& home = dkv_[size_ % 2];
  await(acc_sent[size_ % 2], waited_.backward);
  collective::work home_got = comm_.recv(home.data(), kv_count, wide_, prev);
  await(home_got, waited_.backward);
  await(acc_sent[(size_ + 1) % 2], waited_.backward);
  ops::copy(k_of(home), dk);  // 16-bit: the one rounding of dk, dv and dq
  ops::copy(v_of(home), dv);
  if (narrow_) ops::copy(dqw, dq);
}

}  // namespace troupe::models
