// pipeline_stage: the part of a language model that one pipeline rank holds, run chunk by chunk
// for the microbatches a pipeline schedule (scheduler/pipeline.hpp) interleaves.
//
// With p stages and v chunks per stage the model's L blocks are cut into p * v contiguous virtual
// stages (scheduler::even_partition unless stage_options::first says otherwise); chunk c of stage
// s is virtual stage c * p + s. Virtual stage 0 also holds the embeddings, the last one the final
// norm, the head and the loss (with a tied head, the last stage holds its own copy of the token
// embedding under the same name). Every chunk of the rank lives in ONE slot_list / layer_memory:
// one flat parameter and one flat gradient buffer, parameter names exactly the full model's
// ("wte.weight", "h.<global i>.attn.qkv_proj.weight", ...), so weights move by name between a
// stage and a full model (load_from / store_to) and init_weights(seed) is the full model's init.
//
// Activations of in-flight microbatches: each chunk's activations (its planned activation slots,
// the stage's copies of ids and targets, and the little layer state outside the arena, e.g. the
// loss's count) exist once in the arena, for the microbatch that ran last. When a forward of
// (mb, c) would overwrite the activations of a microbatch whose backward is still to come, they
// are first set aside into a stash buffer (a pool per chunk, grown to the schedule's peak of
// microbatches in flight and reused across steps); a backward whose microbatch is not the one in
// the arena brings it back first. Without recompute the whole pages of a chunk's activation range
// (at least 64 KiB of them) are not copied but swapped with the buffer's pages (mremap,
// page_swap.hpp: a few system calls instead of 2 x 2.4 MB of copies per microbatch on a gpt2-demo
// stage at 1F1B, where the copies took a tenth of the first stage's compute); the bytes at the
// range's edges and the small state are copied, and where the kernel refuses the swap (valgrind)
// everything is. A backward right after its forward (the last stage in 1F1B) moves nothing.
// With recompute (set_recompute, from the model's recompute flag) a stash holds
// only the microbatch's stage input (the ids on virtual stage 0, else the received activation;
// the targets on the last) and the layer state outside the arena; a backward that restores a
// microbatch first runs the chunk's forward again from that input, so every activation is back
// before the backward reads it (Megatron's full recompute with the stage as the checkpointed
// unit): one extra forward per restored microbatch, none when the backward follows its forward.
// Every microbatch must have the planned shape [dims.batch, dims.seq]: the views
// layers save in forward point into the arena and are valid for any microbatch of that shape.
//
// forward / backward run one (microbatch, chunk); the tensors passed between virtual stages are
// [dims.batch, T_local, dim] (boundary(); T_local = T / tp with sequence parallelism) in the
// stage's dtype (boundary_type(): stage_options::type, f32 or bf16). Host (CPU) only; generation
// in f32 only.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "models/layers/sequence_exchange.hpp"
#include "models/layers/sequence_ring.hpp"
#include "models/layers/slots.hpp"
#include "models/layers/weight_grads.hpp"
#include "models/parallel/page_swap.hpp"
#include "models/parallel/tp_generation.hpp"
#include "models/parallel/tp_mappings.hpp"
#include "models/token_objective.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models::parallel {

struct stage_options {
  int stage = 0;           // this rank's pipeline stage, 0-based
  int stages = 1;          // pp
  int virtual_stages = 1;  // chunks per stage (> 1 for the interleaved schedule only)
  // Block boundaries of the p * v virtual stages (p * v + 1 entries: virtual stage k holds blocks
  // [first[k], first[k + 1])), e.g. scheduler::balanced_partition(...).first; empty: even split.
  std::vector<int> first;
  // The stage's parameters, gradients, activations and boundary tensors: f32, or bf16 / f16
  // (trained under mixed_piece.hpp with f32 master weights).
  dtype type = dtype::f32;

  // Stage `stage` of plan.pp with plan.virtual_stages chunks, even split.
  static stage_options of(const scheduler::parallel_plan& plan, int stage);
  // The same, the blocks cut as plan.partition says (scheduler::partition_layers of m, the
  // model's shape with seq, per tensor shard of plan.tp).
  static stage_options of(const scheduler::parallel_plan& plan, int stage,
                          const scheduler::model_shape& m);
};

// Context parallelism inside a stage (context_pipeline.hpp): the stage's tokens are the positions
// `positions` (i32 [T_local]) of each sample, which learned positions read; each held block's
// attention exchanges its heads through exchange(block) (Ulysses) or runs its core through
// `ring`; keep(block, slot, save) moves a block's attention state outside the arena (the
// exchange's heads kept for backward) into stash buffer `slot` of its chunk (save) and back.
struct stage_context {
  tensor positions;
  std::function<sequence_exchange*(std::int64_t block)> exchange;
  sequence_ring* ring = nullptr;
  std::function<void(std::int64_t block, std::size_t slot, bool save)> keep;
};

// Called after the backward of a block (global index) has added its gradients.
using block_hook = std::function<void(std::int64_t block)>;

class pipeline_stage {
 public:
  virtual ~pipeline_stage() = default;
  pipeline_stage(const pipeline_stage&) = delete;
  pipeline_stage& operator=(const pipeline_stage&) = delete;

  layer_memory& memory() { return mem_; }
  const slot_list& slots() const { return slots_; }
  batch_dims dims() const { return dims_; }
  const tp_group& tp() const { return tp_; }
  int stage() const { return stage_; }
  int stages() const { return stages_; }
  int chunks() const { return chunks_; }
  int virtual_stage(int chunk) const { return chunk * stages_ + stage_; }
  bool holds_first(int chunk) const { return virtual_stage(chunk) == 0; }
  bool holds_last(int chunk) const { return virtual_stage(chunk) == stages_ * chunks_ - 1; }
  // Global blocks [first_block(c), end_block(c)) of chunk c.
  std::int64_t first_block(int chunk) const;
  std::int64_t end_block(int chunk) const;
  // The shape of an activation or gradient passed between virtual stages.
  const shape& boundary() const { return boundary_; }
  dtype boundary_type() const { return type_; }  // the stage's dtype (stage_options::type)

  // Context parallelism (stage_context above), set once after construction; refused by stages
  // without it.
  virtual void set_context(const stage_context& c);

  // Starts a step of `microbatches`, dropping whatever a failed step left in flight.
  void begin_step(int microbatches);
  // Forward of `chunk` on microbatch `mb`. in: the token ids i32 [B, T] when holds_first(chunk),
  // else the previous virtual stage's output [boundary()]; targets (i32 [B, T]) and weight are
  // read when holds_last(chunk); y receives the output [boundary()] unless holds_last(chunk).
  // Returns the mean loss when holds_last(chunk), else 0. in and targets are copied: the caller
  // may reuse them at once.
  double forward(int mb, int chunk, const tensor& in, const tensor& targets, double weight,
                 const tensor& y);
  // The per-token objective (models/token_objective.hpp) of the next forward that holds the last
  // chunk, for that microbatch's forward and backward (kept with its stash); empty: the mean
  // cross-entropy. Throws when the stage cannot take one.
  void next_objective(token_objective f);
  // Packed rows (several sequences per row, trunk::set_packing) of the next forward, whichever
  // chunk it runs: segments and positions i32 [B, T] on the host (undefined: one sequence per
  // row), copied by that forward and kept with its microbatch's stash, so the chunk's backward
  // (and a recomputed forward) attend within the same segments. Every virtual stage needs them
  // (each runs attention); the caller passes them before each forward.
  void next_packing(const tensor& segments, const tensor& positions);
  // Backward of `chunk` on `mb`: adds weight * d loss_mb / d params to the gradients. dy: the
  // gradient of the output [boundary()] (ignored when holds_last(chunk)); dx receives the
  // gradient of the input unless holds_first(chunk). after_block (may be empty) is called after
  // each block's backward.
  // With split (a schedule's weight action follows, scheduler/pipeline.hpp): only dx is
  // computed here and the chunk's linear layers queue their weight gradients
  // (models/layers/weight_grads.hpp) for weight(mb, chunk), which calls after_block instead.
  void backward(int mb, int chunk, const tensor& dy, const tensor& dx,
                const block_hook& after_block, bool split = false);
  // The weight gradients a split backward of (mb, chunk) queued, then after_block for each of the
  // chunk's blocks (each block's gradients are complete there).
  void weight(int mb, int chunk, const block_hook& after_block);
  // Microbatches whose forward ran and whose backward (or, when split, weight pass) has not.
  int in_flight() const;
  // Bytes held by the queues of split backwards (copies of dy and x; kept across steps).
  std::size_t weight_queue_bytes() const;
  // Stash buffers allocated so far (all chunks) and their bytes.
  std::size_t stash_buffers() const;
  std::size_t stash_bytes() const;
  // True when stashes keep the stage input only and restored microbatches are recomputed;
  // recomputed(): chunk forwards run again so far (all steps).
  bool recomputes() const { return recompute_; }
  std::int64_t recomputed() const { return recomputed_; }
  // Stashes and restores done by swapping pages rather than copying (all steps).
  std::int64_t page_swaps() const { return page_swaps_; }

  // The parameter the first and the last stage both hold (the tied token embedding), "" when
  // none; its gradient on this stage (undefined when this stage does not hold it).
  const std::string& tied_parameter() const { return tied_name_; }
  tensor tied_grad() const { return tied_grad_; }
  // True when this stage's copy of `parameter` enters the global gradient norm: false for the
  // last stage's copy of the tied embedding and, on tensor ranks > 0, for parameters every
  // tensor shard holds whole.
  bool counts_in_norm(const tensor_slot& parameter) const;

  // This stage's part of `full`'s parameters (from_grads: of its gradients) into its parameters
  // (to_grads: its gradients), matched by name; with tensor parallelism the shard's slice.
  virtual void load_from(const slot_list& full, bool from_grads = false, bool to_grads = false) = 0;
  // The reverse: writes this stage's parameters (from_grads: gradients) into `full`'s parameters
  // (to_grads: gradients) by name, the shard's slice only; the rest of `full` is untouched.
  virtual void store_to(const slot_list& full, bool from_grads = false,
                        bool to_grads = false) const = 0;
  // The weights the full model's init_weights(seed) gives.
  virtual void init_weights(std::uint64_t seed) = 0;

  // Generation through the stages (pipeline_generation.hpp drives them). begin_generation plans
  // this stage's decoding state (tp_generation.hpp: the kv caches of its blocks over their tensor
  // shard's heads, the passes, the logits) for `batch` sequences of up to `capacity` positions
  // (0: max_seq) and empties it; between training steps only (no microbatch in flight: a
  // generation step overwrites the chunks' activations). generation(): that state.
  void begin_generation(std::int64_t batch, std::int64_t capacity = 0);
  tp_generation& generation();
  // One cached pass of chunk c over the new positions start..start+n-1, every tensor shard
  // holding the rows whole (the region's full-sequence path, tp_compose.hpp). in: the ids, i32
  // [B, n], when holds_first(c), else the previous virtual stage's output [B, n, C]; y receives
  // the output [B, n, C] unless holds_last(c), which writes the shard's vocabulary columns of the
  // last position into generation().local_logits(B).
  virtual void step_chunk(int chunk, const tensor& in, const tensor& y, std::int64_t start) = 0;

 protected:
  // Checks the options against n_layer and sets the partition; `what` names the model in errors.
  pipeline_stage(std::string what, std::int64_t n_layer, batch_dims dims, const stage_options& o,
                 tp_group tp, shape boundary);

  // Declaration: everything chunk c declares (its activations above all) goes between
  // open_chunk(c) and close_chunk(c); then plan_memory() makes the memory and the stash tables.
  void open_chunk(int chunk);
  void close_chunk(int chunk);
  void plan_memory();
  // Before plan_memory(): stash the stage input only and recompute (see the top of this file).
  void set_recompute(bool on) { recompute_ = on; }
  void set_tied(std::string name, const tensor& grad) {
    tied_name_ = std::move(name);
    tied_grad_ = grad;
  }

  // The model: forward / backward of one chunk on the microbatch in the arena. in is ids_buffer()
  // for the first virtual stage; targets is targets_buffer() for the last.
  virtual double run_forward(int chunk, const tensor& in, const tensor& targets,
                             const tensor& y) = 0;
  virtual void run_backward(int chunk, const tensor& dy, const tensor& dx, double weight,
                            const block_hook& after_block) = 0;
  // The head's per-token objective for the forwards that follow (next_objective); false when
  // the model has none.
  virtual bool use_objective(token_objective f) {
    (void)f;
    return false;
  }
  // Points chunk c's blocks (and its front's positions when it holds the first virtual stage) at
  // a microbatch's packed rows, or back to one sequence per row (undefined tensors). The tensors
  // are the chunk's own buffers, stable for the stage's life. False when the model cannot run
  // packed rows.
  virtual bool use_packing(int chunk, const tensor& segments, const tensor& positions) {
    (void)chunk;
    return !segments.defined() && !positions.defined();
  }
  // Layer state outside the arena (e.g. the loss's count), kept per stash buffer `slot`.
  virtual void save_extra(int chunk, std::size_t slot) {
    (void)chunk;
    (void)slot;
  }
  virtual void restore_extra(int chunk, std::size_t slot) {
    (void)chunk;
    (void)slot;
  }
  // What begin_generation plans the caches and logits for (the model's constructor sets it): the
  // shard's key/value heads, the head size, the whole vocabulary and the model's positions.
  void set_generation_shape(std::int64_t n_kv_head, std::int64_t head_dim, std::int64_t vocab,
                            std::int64_t max_seq);
  // The kv cache of block `block` (global index, held here), after begin_generation.
  const kv_layer& cached(std::int64_t block) const;

  const tensor& ids_buffer() const { return ids_; }
  const tensor& targets_buffer() const { return targets_; }
  const std::string& what() const { return what_; }

  slot_list slots_;
  layer_memory mem_;

 private:
  struct chunk_state {
    std::size_t slot_begin = 0, slot_end = 0;  // its slots in slots_
    std::vector<tensor> state;                 // what a stash copies
    std::size_t bytes = 0;
    std::vector<owned_tensor> pool;  // stash buffers (u8)
    std::vector<std::size_t> free;   // unused pool entries
    std::vector<int> stashed;        // per microbatch: its pool entry, -1 none
    int live = -1;                   // the microbatch whose activations are in the arena
    owned_tensor input;              // recompute, not virtual stage 0: the stage input [boundary]
    // Without recompute: the whole pages of the chunk's activation range, whose pages a stash
    // swaps with its buffer's instead of copying (page_swap.hpp); `state` then holds the edges.
    std::byte* page_lo = nullptr;
    std::size_t page_bytes = 0;
    std::vector<mapped_pages> pages;  // per pool entry
    // Packed rows of the microbatch in the arena (next_packing): i32 [B, T] each, and whether it
    // has them; per pool entry: whether its microbatch has them, and a copy of both when it does.
    owned_tensor segments, positions;
    bool packed = false;
    std::vector<char> packed_saved;
    std::vector<owned_tensor> packing_saved;
  };
  void apply_packing(int chunk);  // use_packing with the chunk's buffers or none
  // Sets chunk's page range up when it is worth it; returns its bytes (0: copy everything).
  std::size_t swap_activation_pages(int chunk);
  void move_pages(int chunk, std::size_t slot, bool to_arena);
  void rerun(int chunk);
  void check_mb(int mb, int chunk, const char* op) const;
  void stash(int chunk, int mb);
  void restore(int chunk, int mb);

  std::string what_;
  batch_dims dims_;
  tp_group tp_;
  int stage_, stages_, chunks_;
  std::vector<int> first_;  // p * v + 1 block boundaries
  shape boundary_;
  dtype type_;
  std::vector<chunk_state> chunk_;
  // per (chunk, mb): 0 idle, 1 forward done, 2 split backward done (its weight pass not)
  std::vector<char> pending_;
  std::vector<deferred_weight_grads> queues_;  // for split backwards, reused across steps
  std::vector<int> queue_of_;                  // per (chunk, mb): its entry of queues_, -1 none
  std::vector<int> free_queues_;
  std::vector<double> weight_;  // per microbatch
  token_objective next_objective_;
  tensor next_segments_, next_positions_;  // next_packing's (the caller's, until the forward)
  int microbatches_ = 0;
  owned_tensor ids_, targets_;  // i32 [B, T]
  bool recompute_ = false;
  std::int64_t recomputed_ = 0;
  owned_tensor rerun_out_;  // recompute: where a rerun writes a chunk's output [boundary]
  mapped_pages swap_tmp_;   // the page swaps' go-between
  std::int64_t page_swaps_ = 0;
  bool swap_off_ = false;  // the kernel refused a swap once: copy from then on
  std::string broken_;     // a swap failed half way: the error; begin_step refuses
  std::string tied_name_;
  tensor tied_grad_;
  tp_generation_plan gen_shape_;  // set_generation_shape's part
  std::unique_ptr<tp_generation> gen_;
};

}  // namespace troupe::models::parallel
