// offload_trainer: models/trainer.hpp's step for a GPT-2 or a Llama whose parameters, gradients and
// AdamW state live in chunks under a memory::tier_manager (device / host / NVMe), ZeRO-Infinity
// style. The model runs in the streamed placement of its trunk (models/offload/streamed_model.hpp),
// with per-block recompute when its config asks for it.
//
// Layout: the parameters, in the order of first use (the slot order of the forward), are packed
// into chunks of one size chosen among candidates to waste the fewest bytes
// (memory::choose_chunk_size); the gradients and the moments m and v use the same layout, so
// chunk i of each kind covers the same tensors. Chunk ids in the tier manager: parameters
// 0..n-1, gradients n..2n-1, m 2n..3n-1, v 3n..4n-1.
//
// Placement (the home tier of each chunk): fixed: the first round(param_fraction * n) parameter
// chunks (and their gradients) live in param_tier, the rest on the device; the first
// round(optim_fraction * n) optimizer-state chunks live in optim_tier, the rest on the device.
// automatic: leaves room on the device for the non-model memory (activations and scratch) and
// the chunk slots one unit needs at once, and keeps as many parameter (+ gradient) chunks and
// then optimizer-state chunks resident on the device as fit; the rest go to param_tier /
// optim_tier. The non-model memory is first the model's plan (its arenas); the first step then
// MEASURES it (the arenas plus the peak of host allocations the step made beyond the chunks and
// pools, memory::stats) and, when the measured figure places the chunks differently, the chunks
// move to the new placement before step 2 (the old and the new tier manager coexist during the
// move). The optimizer of chunk i runs on the device when its parameters and state all live
// there, and otherwise on the host (the CPU AdamW, chunk by chunk), where gradients of such
// chunks live too (in optim_tier).
//
// A step (f32): grad_accum micro-batches, each forward unit by unit with each unit's parameter
// chunks brought into the device region and backward in reverse with parameter and gradient
// chunks there (gradients are zeroed at their first touch in the step and accumulate after; in
// the last micro-batch each tensor's gradient is scaled by 1 / grad_accum and its square summed
// for the global norm as soon as it is final), then clipping and AdamW chunk by chunk in the
// chunks' order. The tier manager knows this schedule: it prefetches along it (NVMe reads are
// asynchronous, so the next chunks' reads overlap the CPU AdamW of the current one) and evicts
// by Belady. The losses and weights equal trainer's on gpt or llama bit for bit (up to the
// grad-norm sum's order, in double).
//
// bf16 (train.precision "bf16"): trainer's mixed precision over the same chunks. Every chunk stays
// f32: the parameter chunks hold the f32 master weights, the gradient chunks f32 gradients, m and
// v f32 moments, so the layout, the placement and the optimizer's pass are the f32 ones. The model
// computes in bf16 (its activations and scratch are bf16): before a unit runs, its master weights
// are rounded into a bf16 working copy (one unit's parameters, reused by every unit) and, for its
// backward, its f32 gradients so far into a bf16 working gradient (they are bf16 values until the
// step's last micro-batch, so the copy is exact); the unit's backward accumulates in bf16 as the
// whole bf16 model does, and the result goes back into the f32 gradient chunk (exact). In the last
// micro-batch a final gradient is then scaled and summed in f32, as trainer converts, unscales and
// clips its f32 copy. The losses and master weights equal trainer's in bf16 bit for bit. Cost: the
// rounding per unit use (forward, backward), 2 x (the largest unit's parameters) x 2 bytes of
// working copies counted with the non-model memory, and the f32 gradients (trainer keeps a bf16 and
// an f32 gradient buffer; here the bf16 gradient exists for one unit at a time).
//
// Errors of the tiers (a full NVMe tier, an I/O error, a checksum mismatch) surface from step()
// as troupe::error naming the store's path; the chunks the step pinned are released, so the
// owner can stop cleanly (checkpoints written before are separate files and stay intact).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "memory/chunk.hpp"
#include "memory/tier_manager.hpp"
#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/hf/config.hpp"
#include "models/llama.hpp"
#include "models/offload/streamed_model.hpp"
#include "models/train_config.hpp"
#include "models/trainer.hpp"

namespace troupe::models {

struct offload_placement {
  enum class mode : std::uint8_t { fixed, automatic };
  mode how = mode::fixed;
  double param_fraction = 0;                     // fixed: parameter (and gradient) chunks offloaded
  double optim_fraction = 0;                     // fixed: optimizer-state chunks offloaded
  memory::tier param_tier = memory::tier::host;  // host or nvme
  memory::tier optim_tier = memory::tier::host;  // host or nvme
};

struct offload_options {
  std::size_t device_bytes = 0;           // the device budget (non-model memory included)
  std::size_t host_bytes = 0;             // the host budget for chunks (0: unlimited)
  std::string nvme_dir;                   // needed when a tier is nvme
  std::uint64_t nvme_capacity_bytes = 0;  // limit on the NVMe tier's file (0: the disk's size)
  // The NVMe tier's page I/O (e.g. the NVMe actor's client, actors/nvme_actor.hpp); null: a store
  // of the tier manager's own in nvme_dir (memory::tier_manager_options::nvme_io).
  std::shared_ptr<memory::io::page_io> nvme_io;
  int prefetch_depth = 4;
  // The CPU AdamW of chunk i overlaps bringing in chunk i + 1 (when the host and device budgets
  // hold both chunk groups at once; otherwise the optimizer runs one chunk at a time).
  bool overlap_optimizer = true;
  offload_placement placement;
  std::vector<std::size_t> chunk_candidates;  // empty: memory::default_chunk_candidates()
};

class offload_trainer {
 public:
  // The model's own recompute field says whether each block runs its forward again in backward.
  offload_trainer(const gpt_config& model, const train_config& cfg, const offload_options& opt);
  offload_trainer(const llama_config& model, const train_config& cfg, const offload_options& opt);
  // The model an HF config describes (either family), with per-block recompute when
  // cfg.recompute.
  offload_trainer(const hf::model_config& model, const train_config& cfg,
                  const offload_options& opt);

  // Parameters by name from / to another model's slots (e.g. a gpt's, to start from the same
  // weights and to compare after training). In bf16, set_weights rounds the weights through bf16
  // as trainer's master weights start (the bf16 model's values): give it a bf16 model's weights
  // to start from them exactly (an f32 model's initial draws, rounded again, can differ in the
  // last bit from the bf16 model's); copy_weights_to gives the f32 master weights.
  void set_weights(const slot_list& src);
  void copy_weights_to(const slot_list& dst);

  step_result step(const trainer::batch_source& data);
  std::int64_t steps_done() const { return step_; }

  // Checkpoints in the layout of trainer::save (HF weights, config.json, optimizer.safetensors
  // with m and v flat in the model's parameter order, trainer_state.json), so either trainer can
  // resume the other's. `staging` is an f32 model of the same config (any batch dims): its
  // parameters carry the (master) weights on the way. The moments are laid out as trainer lays
  // them out in the run's precision (layer_memory in f32 or bf16: place_params), so a bf16 run's
  // checkpoint is the plain bf16 trainer's.
  expected<std::filesystem::path> save(const std::filesystem::path& folder,
                                       const hf::model_config& cfg, causal_lm& staging);
  expected<std::int64_t> resume(const std::filesystem::path& folder, const hf::model_config& cfg,
                                causal_lm& staging);

  const memory::chunk_size_choice& chunking() const { return chunks_; }
  std::int32_t chunk_count() const { return chunks_.layout.chunks; }
  memory::tier_manager& tiers() { return tiers_; }
  // The planned non-model memory (the model's activation and scratch arenas; in bf16 the working
  // copies of one unit's parameters and gradients too).
  std::size_t non_model_bytes() const { return model_->non_model_bytes() + work_bytes_; }
  // automatic: the non-model memory measured in the first step (0 before it, or when fixed).
  std::size_t measured_non_model_bytes() const { return measured_; }
  // automatic: whether the measurement moved chunks to a new placement.
  bool replaced() const { return replaced_; }
  std::size_t model_state_bytes() const;  // parameters, gradients, m and v (chunked)
  memory::tier param_home(std::int32_t chunk) const { return tiers_.home(chunk); }
  memory::tier optim_home(std::int32_t chunk) const {
    return tiers_.home(2 * chunk_count() + chunk);
  }
  // Makes the tier manager lay out its pools now and checks that they hold what a step pins at
  // once; throws troupe::error naming the budget otherwise.
  void check_budgets();
  // Chunks a step pins at once in `where` outside their home there (the slots it needs).
  std::size_t pinned_at_once(memory::tier where) const;
  // Whether the optimizer overlaps (known after check_budgets or the first step).
  bool optimizer_overlaps() const { return overlap_; }

 private:
  offload_trainer(std::unique_ptr<streamed_model> model, const train_config& cfg,
                  const offload_options& opt);
  tensor view(std::byte* base, std::int32_t tensor_index) const;
  // Homes for every chunk in `into` (registers them), from a non-model figure (automatic).
  void place(memory::tier_manager& into, std::size_t non_model);
  void build_schedule();
  step_result run_step(const trainer::batch_source& data);
  // Copies chunk kind k (0 parameters, 2 m, 3 v) to / from the named parameter slots of `s`
  // (parameters into their fields, m and v into their gradient fields).
  void copy_kind(const slot_list& s, int kind, bool out);
  // automatic, after the first step: places again with the measured non-model memory.
  void place_measured(std::size_t measured);
  memory::tier access_tier(std::int32_t id) const;  // device when home there, else host
  bool mixed() const { return compute_ != dtype::f32; }
  // bf16: the working copy of unit u's k-th tensor in buf (work_params_ or work_grads_).
  tensor work_view(const tensor& buf, std::int32_t u, std::size_t k) const;
  // bf16: binds unit u's tensors in chunk c: their values rounded from p (and their gradients
  // from g, when given) into the working copies.
  void bind_mixed(std::int32_t u, std::int32_t c, std::byte* p, std::byte* g);
  void round_master();  // bf16: the master weights through bf16 and back
  // Copies m (kind 2) or v (kind 3) to / from `flat`, laid out as flat_layout places the
  // parameters.
  void copy_moments(const param_placement& flat_layout, int kind, const tensor& flat, bool out);
  void check_staging(causal_lm& staging) const;  // f32: it carries the master weights

  train_config cfg_;
  dtype compute_;  // the model's dtype: f32, or bf16 (f32 master weights)
  offload_options opt_;
  std::unique_ptr<streamed_model> model_;
  std::vector<std::int32_t> param_slots_;  // tensor j -> its index in model_->slots()
  memory::chunk_size_choice chunks_;
  memory::tier_manager tiers_;
  std::vector<std::vector<std::int32_t>> unit_chunks_;   // unit -> its chunks, in order
  std::vector<std::vector<std::int32_t>> unit_tensors_;  // unit -> its tensors
  std::vector<std::int32_t> last_backward_unit_;         // tensor -> unit finishing its grad
  std::vector<bool> decays_;                             // tensor -> weight decay applies
  std::vector<memory::tier> optim_at_;                   // chunk -> where its AdamW runs
  std::vector<memory::chunk_use> schedule_;
  std::vector<bool> grad_touched_;
  std::int64_t step_ = 0;
  std::size_t measured_ = 0;
  bool replaced_ = false;
  bool laid_out_ = false;  // check_budgets ran on the current tier manager
  bool overlap_ = false;   // the optimizer's update overlaps the next chunk's transfers
  std::vector<std::int32_t> rows_, targets_;
  // bf16: one unit's parameters and gradients (bf16, 1-D); unit -> its tensors' offsets there.
  owned_tensor work_params_, work_grads_;
  std::vector<std::vector<std::int64_t>> work_at_;
  std::size_t work_bytes_ = 0;
};

}  // namespace troupe::models
