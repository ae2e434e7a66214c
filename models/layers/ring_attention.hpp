// ring_attention: scaled-dot-product attention over a sequence split across the cp ranks of a
// context-parallel group, no rank ever holding more than its own part of q, k and v plus two key/
// value blocks in flight (the ring attention of Liu et al. 2023, with the zigzag load balance of
// zhuzilin/ring-flash-attention and Megatron's context parallel).
//
// Each rank holds its part of q [B, Tl, Hq, D] and of k, v [B, Tl, Hkv, D] (Tl = T / cp; Hq a
// multiple of Hkv: grouped-query attention), cut from the full sequence by sequence_split.hpp's
// layout. Forward, cp steps: at step s the rank attends its queries to the key/value block of rank
// (r - s) mod cp with the flash-style kernel (ops::attention: no T x T matrix, the block's
// log-sum-exp saved), folds the block's output into its running output with ops::attention_merge
// (online softmax on the log-sum-exps), and meanwhile passes the block on to rank r + 1 and
// receives the next one from rank r - 1 (send and recv posted before the compute, waited after:
// the transfer overlaps the step's compute). Under the causal mask a block is either the own one
// (causal), or wholly visible, or wholly hidden (skipped) - for the zigzag layout per half:
//
//   block j == r: causal over the local rows (chunk r before chunk 2cp-1-r keeps causal order)
//   block j <  r: all local queries see the block's first chunk (j), none its second
//   block j >  r: only the second local chunk (2cp-1-r) sees the block, all of it
//
// so every rank computes cp - 1 half blocks besides its own: the same work on every rank. With
// the contiguous layout rank r computes r full blocks and skips cp - 1 - r.
//
// Backward (the same ring): the saved output and final log-sum-exp let each block's share of the
// gradient be computed on its own (ops::attention_backward recomputes P = exp(S - lse) of the
// block and uses rowsum(dO * O) of the whole row). dq accumulates locally; the key/value block
// travels on as in forward, and with it an accumulator of its dk, dv, which each rank adds its
// share to and passes on, so that after cp steps every block's gradient has come home to its
// owner. Each step's dk/dv accumulator is received while the step computes and sent when the
// step's share is added.
//
// Memory per rank, beyond the caller's q, k, v, out, lse (and dout, dq, dk, dv): two packed
// key/value blocks (2 x 2 x B Tl Hkv D elements), the block output and log-sum-exp (B Tl Hq (D+1)),
// and for backward two dk/dv accumulators, a block's dk/dv share and dq share, and the log-sum-exp
// halves (workspace_bytes() says how much). Nothing scales with T x T or with the full T.
//
// The op runs on any communicator (collective/communicator.hpp: send/recv of the group), with
// host tensors: ops::attention_merge has no CUDA kernel yet. f32 and f64, and bf16 and f16 (the
// 16-bit compute path of every other op, tensor/ops.hpp): q, k, v, out and the gradients are
// 16-bit, the key/value blocks travel in 16 bits, but every block is computed from them in f32
// (a converted copy of q, of the block, of out and dout), the online-softmax statistics (lse, the
// running output, the dk/dv accumulators that travel with the blocks in backward, dq) are kept in
// f32, and out, dq, dk and dv are rounded to 16 bits once at the end, as the single-rank kernel
// rounds its results once. The caller's lse may be f32 or 16-bit (as the attention layer keeps it
// in a 16-bit model); the running one is f32 either way, and a 16-bit lse is read into f32 for
// backward, as the single-rank kernel reads it.
#pragma once

#include <cstddef>
#include <cstdint>

#include "collective/communicator.hpp"
#include "models/layers/sequence_split.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct ring_attention_config {
  std::int64_t batch = 0;      // B
  std::int64_t local_seq = 0;  // Tl = T / cp, the tokens of this rank (even for zigzag)
  std::int64_t n_head = 0;     // Hq
  std::int64_t n_kv_head = 0;  // Hkv (0: n_head)
  std::int64_t head_dim = 0;   // D
  dtype type = dtype::f32;
  sequence_layout layout = sequence_layout::zigzag;
  bool causal = true;
  double scale = 0.0;  // 0: 1 / sqrt(D)
};

class ring_attention {
 public:
  // Plans the workspace for `cfg` on this rank of `cp` (the context-parallel group; kept by
  // reference, must outlive the op). Throws troupe::error naming the field when the config does
  // not fit (heads, a zigzag Tl that is odd, a dtype other than f32/f64/bf16/f16).
  ring_attention(collective::communicator& cp, const ring_attention_config& cfg);

  // out [B, Tl, Hq, D] and lse [B, Hq, Tl] (contiguous) receive this rank's rows of the attention
  // over the whole sequence; q, k, v as in the header comment (views with a contiguous last
  // dimension are fine). Every rank of the group must call it together.
  void forward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
               const tensor& lse);
  // dq, dk, dv (like q, k, v) are overwritten with this rank's rows of the gradients; out and lse
  // are forward's.
  void backward(const tensor& q, const tensor& k, const tensor& v, const tensor& out,
                const tensor& lse, const tensor& dout, const tensor& dq, const tensor& dk,
                const tensor& dv);

  const ring_attention_config& config() const { return cfg_; }
  // Bytes the op holds for its own use (everything it allocated at construction).
  std::size_t workspace_bytes() const;
  // Seconds the last forward and the last backward spent blocked in the ring's sends and receives:
  // the transfers its compute did not hide, plus waiting for a slower peer. For benchmarks.
  struct transfer_waits {
    double forward = 0, backward = 0;
  };
  const transfer_waits& waits() const { return waited_; }

 private:
  enum class visibility : std::uint8_t {
    causal,
    full,
    second_half_sees_all,
    all_see_first_half,
    hidden
  };
  visibility block_visibility(int owner) const;
  void pack_kv(const tensor& k, const tensor& v, const tensor& kv) const;
  tensor k_of(const tensor& kv) const;
  tensor v_of(const tensor& kv) const;

  collective::communicator& comm_;
  ring_attention_config cfg_;
  int rank_ = 0, size_ = 1;
  std::int64_t half_ = 0;  // zigzag chunk length Tl / 2
  transfer_waits waited_;

  owned_tensor kv_[2];        // packed k, v blocks [2, B, Tl, Hkv, D]: the one in use, the next
  owned_tensor part_out_;     // [B, Tl, Hq, D]: a block's output, or its dq share in backward
  owned_tensor part_lse_;     // [B, Hq, Tl]: a block's log-sum-exp
  owned_tensor dkv_[2];       // backward: dk, dv accumulators travelling with the blocks
  owned_tensor dkv_part_;     // backward: a block's dk, dv share
  owned_tensor lse_half_[2];  // backward (zigzag): the saved lse of each local chunk, contiguous
  // 16-bit types: the statistics' and compute type (f32) and the f32 copies computed from.
  dtype wide_ = dtype::f32;
  bool narrow_ = false;     // cfg.type is bf16 or f16
  owned_tensor kv_wide_;    // the block in use, [2, B, Tl, Hkv, D]
  owned_tensor lse_wide_;   // the log-sum-exp [B, Hq, Tl] when the caller keeps a 16-bit one
  owned_tensor q_wide_;     // q, then in backward q again ([B, Tl, Hq, D])
  owned_tensor out_wide_;   // the running output; in backward forward's output
  owned_tensor dout_wide_;  // backward: dout
  owned_tensor dq_wide_;    // backward: dq accumulated
};

}  // namespace troupe::models
