// Slots: how layers name the tensors they need, and how a caller gives them planned memory.
//
// A layer never allocates. Its parameters, their gradients, the activations its backward reads and
// the scratch it uses inside one forward or backward call are tensor fields; `declare` lists them
// in a slot_list (a dotted name, a shape, the field to fill). A model declares all its layers,
// then builds one layer_memory from the list: that plans the memory (memory::plan_memory), makes
// the arenas and writes a bound tensor into every field, all before step 1.
//
//   slot_list slots;
//   block.declare(slots, "h.0", {batch, seq});   // nested layers open nested scopes
//   layer_memory mem(slots, dtype::f32, device::cpu());
//   block.forward(x, y); ... block.backward(dy, dx);
//
// Parameters and gradients live in two arenas with the same layout, so an optimizer or an
// allreduce may treat each as one flat buffer (the padding between tensors stays zero). Parameters
// lie in declaration order (a block's parameters are one range of the flat buffer); on the host
// both buffers are mapped in whole pages and ranges of them can be given back (release_params for
// ZeRO 3, release_grads for ZeRO 2 and 3: models/parallel/data_parallel.hpp).
// Activations are live for the whole step. Scratch declared inside a scope is live only while
// that scope's layer runs, so sibling layers share the same scratch bytes.
//
// Recompute (activation checkpointing): activations declared inside a scope opened with
// enter_recomputed (nested scopes included) are live only while that scope is open, like its
// scratch, so sibling recomputed scopes (the blocks of a model) share ONE set of activation bytes.
// The caller then keeps the scope's input outside it and, before the scope's backward, runs its
// forward again from that input: the bytes hold the last forward's values of whichever recomputed
// scope ran last.
//
// The slot_list keeps pointers to the fields: a layer must not move between declare and the
// construction of its layer_memory.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "memory/arena.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

// The extents of one batch: `batch` sequences of `seq` positions. Layers size their activations
// for it; a forward may then run on any batch with at most as many rows (and, for attention,
// at most `seq` positions).
struct batch_dims {
  std::int64_t batch = 1;
  std::int64_t seq = 1;
  std::int64_t rows() const { return batch * seq; }
};

enum class slot_kind : std::uint8_t { param, activation, scratch };

// What a parameter's family draws for it at init: N(0, init_std) (weights and embeddings; a
// family may scale a residual_out projection), zeros (biases, norm biases) or ones (norm weights).
enum class param_init : std::uint8_t { normal, zeros, ones };

// A parameter's facts, declared by the layer that declares the parameter (slot_list::param) and
// read by everything that would otherwise guess them from its name or shape: how a
// tensor-parallel group holds it, how its family initialises it. The layers of models/layers
// declare what their parameter would be in a tensor-parallel shard (a column-parallel weight is
// split along its rows, a norm replicated), so a whole model and its shards agree.
struct param_spec {
  // Tensor parallelism: replicated (every shard holds all of it, and its gradient is the same
  // on every shard) or split along `axis` into the group's equal parts. With `sections` (extents
  // along the axis that add up to it, in the declaring model's own extents) each section is split
  // separately: GPT-2's fused qkv rows are the sections q, k and v, each split by heads. A shard
  // declares its own extents (the sections of its part), the unsharded model the whole ones.
  bool split = false;
  std::int8_t axis = 0;
  std::vector<std::int64_t> sections = {};
  param_init init = param_init::normal;
  // A projection that writes into the residual stream (attention's o_proj, the MLP's output):
  // GPT-2 scales its init by 1 / sqrt(2 n_layer).
  bool residual_out = false;
  // An embedding table (or a tied head's copy of one): with train.decay_exempt it does not decay.
  bool embedding = false;
  // Expert parallelism: the index of the MoE expert this parameter belongs to (-1: none, the
  // parameter is every expert-parallel rank's). An expert-parallel group holds each expert whole on
  // the rank its index maps to, so "split over experts" is this index, not a layout of its own:
  // the expert's tensors keep their tensor-parallel layout above. Set by slot_list::mark_expert
  // around the expert's declare (models/layers/moe_ffn.hpp), not by the layers.
  std::int32_t expert = -1;

  static param_spec replicated(param_init i = param_init::normal) {
    param_spec s;
    s.init = i;
    return s;
  }
  static param_spec split_along(int axis, param_init i = param_init::normal,
                                std::vector<std::int64_t> sections = {}) {
    param_spec s;
    s.split = true;
    s.axis = static_cast<std::int8_t>(axis);
    s.sections = std::move(sections);
    s.init = i;
    return s;
  }
};

struct tensor_slot {
  slot_kind kind = slot_kind::param;
  std::string name;  // dotted, e.g. "h.0.attn.qkv_proj.weight"
  shape sizes;
  tensor* field = nullptr;  // receives the bound tensor
  tensor* grad = nullptr;   // params: receives the gradient (same shape)
  // The live interval (see memory::size_spec): the whole step, but for scratch the interval of
  // its scope and for activations in a recomputed scope the interval of the outermost one.
  std::int64_t first = 0;
  std::int64_t last = 0;
  param_spec spec = {};  // params: layout and init (above)
  // The block (the model's layer index) whose declare() declared the slot, from the enclosing
  // slot_list::block_mark; -1 outside the blocks (embeddings, final norm, head).
  std::int64_t block = -1;
};

class slot_list {
 public:
  // A named scope: names declared while it is open get "<scope>." in front; scratch declared in it
  // is live only while it is open. Closes when destroyed.
  class scope {
   public:
    scope(scope&& o) noexcept : list_(o.list_) { o.list_ = nullptr; }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;
    scope& operator=(scope&&) = delete;
    ~scope() {
      if (list_ != nullptr) list_->leave();
    }

   private:
    friend class slot_list;
    explicit scope(slot_list* l) : list_(l) {}
    slot_list* list_;
  };

  [[nodiscard]] scope enter(std::string_view name);
  // A scope whose layers are recomputed before their backward: the activations declared in it
  // (nested scopes included) are live only while it is open (see the top of this file).
  [[nodiscard]] scope enter_recomputed(std::string_view name);
  std::string prefix() const;  // the dotted name of the open scopes ("" at top level)

  // Marks every slot declared while it lives as block `index`'s (tensor_slot::block): a model
  // holds one around each block's declare. Unmarks when destroyed.
  class block_mark {
   public:
    block_mark(block_mark&& o) noexcept : list_(o.list_), outer_(o.outer_) { o.list_ = nullptr; }
    block_mark(const block_mark&) = delete;
    block_mark& operator=(const block_mark&) = delete;
    block_mark& operator=(block_mark&&) = delete;
    ~block_mark() {
      if (list_ != nullptr) list_->block_ = outer_;
    }

   private:
    friend class slot_list;
    block_mark(slot_list* l, std::int64_t outer) : list_(l), outer_(outer) {}
    slot_list* list_;
    std::int64_t outer_;
  };
  [[nodiscard]] block_mark mark_block(std::int64_t index);

  // Marks every parameter declared while it lives as expert `index`'s (param_spec::expert): an MoE
  // layer holds one around each expert's declare. Unmarks when destroyed.
  class expert_mark {
   public:
    expert_mark(expert_mark&& o) noexcept : list_(o.list_), outer_(o.outer_) { o.list_ = nullptr; }
    expert_mark(const expert_mark&) = delete;
    expert_mark& operator=(const expert_mark&) = delete;
    expert_mark& operator=(expert_mark&&) = delete;
    ~expert_mark() {
      if (list_ != nullptr) list_->expert_ = outer_;
    }

   private:
    friend class slot_list;
    expert_mark(slot_list* l, std::int32_t outer) : list_(l), outer_(outer) {}
    slot_list* list_;
    std::int32_t outer_;
  };
  [[nodiscard]] expert_mark mark_expert(std::int32_t index);

  void param(std::string_view name, const shape& sizes, tensor& value, tensor& grad,
             param_spec spec = {});
  void activation(std::string_view name, const shape& sizes, tensor& t);
  void scratch(std::string_view name, const shape& sizes, tensor& t);

  const std::vector<tensor_slot>& slots() const { return slots_; }
  std::int64_t param_count() const;  // number of parameter elements

 private:
  struct open_scope {
    std::string name;
    std::int64_t opened;
    bool recomputed;
    // Indices of the slots whose interval ends when it closes: the scratch declared directly in
    // it and, for the outermost recomputed scope, the activations declared anywhere inside.
    std::vector<std::size_t> closing;
  };
  std::string full_name(std::string_view name) const;
  void add(tensor_slot s);
  void add_closing(tensor_slot s, open_scope& closes_with);
  void leave();

  std::vector<tensor_slot> slots_;
  std::vector<open_scope> scopes_;
  std::int64_t clock_ = 0;
  std::int64_t block_ = -1;
  std::int32_t expert_ = -1;
};

// Process-wide ledger of parameter memory: the bytes of every layer_memory's params() alive now
// and the most alive at once since the process started, so that a rank of a parallel plan can show
// it never held more parameters than its piece (gradients, activations and scratch not counted).
struct param_bytes_stats {
  std::int64_t in_use = 0, peak = 0;
};
param_bytes_stats param_bytes();

// The storage of every slot of a slot_list, bound into the fields the slots point to.
class layer_memory {
 public:
  layer_memory() = default;
  layer_memory(const slot_list& slots, dtype t, device dev = device::cpu());
  layer_memory(layer_memory&&) noexcept = default;
  layer_memory& operator=(layer_memory&&) noexcept = default;

  // All parameters (and all gradients) as one flat 1-D tensor, padding included.
  const tensor& params() const { return params_flat_; }
  const tensor& grads() const { return grads_flat_; }
  void zero_grads() const;
  // Gives back the whole pages inside elements [first, first + count) of params() (host only; the
  // partial pages at either end stay): they read as zeros until written. Returns the bytes given
  // back (0 on a device).
  std::size_t release_params(std::int64_t first, std::int64_t count);
  // Bytes of the parameter buffer resident in memory now (mincore; param_bytes() on a device).
  std::size_t resident_param_bytes() const;
  // The same for grads() (ZeRO 2 and 3 give a bucket's gradients back once they are reduced),
  // except that the whole range reads as zeros afterwards: the whole pages are given back (host),
  // the partial pages' bytes inside the range are zero-filled (on a device: all of it). Returns
  // the bytes given back.
  std::size_t release_grads(std::int64_t first, std::int64_t count);
  std::size_t resident_grad_bytes() const;

  std::size_t param_bytes() const { return params_.capacity(); }
  std::size_t activation_bytes() const { return activations_.capacity(); }
  std::size_t scratch_bytes() const { return scratch_.capacity(); }
  std::size_t scratch_bytes_without_reuse() const { return scratch_naive_; }

 private:
  // Counts its bytes in param_bytes() while it lives (moves with the memory).
  class counted {
   public:
    counted() = default;
    explicit counted(std::size_t bytes);
    counted(counted&& o) noexcept : bytes_(o.bytes_) { o.bytes_ = 0; }
    counted& operator=(counted&& o) noexcept;
    counted(const counted&) = delete;
    counted& operator=(const counted&) = delete;
    ~counted();

   private:
    std::size_t bytes_ = 0;
  };
  memory::arena params_, grads_, activations_, scratch_;
  counted param_share_;
  tensor params_flat_, grads_flat_;
  std::size_t scratch_naive_ = 0;
};

// Where layer_memory(slots, t) puts the parameters, computed without memory: the offset (in
// elements of params()) of every parameter slot, in slot order, and params().numel(), padding
// included. A model built with no memory (gpt_config::unbound, llama_config::unbound) still
// describes its layout this way.
struct param_placement {
  std::vector<std::int64_t> offsets;
  std::int64_t numel = 0;
};
param_placement place_params(const slot_list& slots, dtype t);

// Receives a model's initial values parameter after parameter (gpt::init_values,
// llama::init_values): the slot and its values, a host f64 tensor of its shape (valid during the
// call).
using init_sink = std::function<void(const tensor_slot& slot, const tensor& values)>;
// A family's initial values for every parameter of `slots`, in declaration order, into `each`,
// as their param_spec::init says: N(0, std) (times residual_scale for a residual_out parameter),
// zeros or ones. One generator seeded with `seed` draws the normal values in declaration order,
// so the values depend on the seed and the parameters only.
void draw_init(const slot_list& slots, std::uint64_t seed, double std, double residual_scale,
               const init_sink& each);
// The sink of init_weights: `values` into the slot's bound parameter (on any device), rounded to
// the parameter's dtype; an f64 parameter gets the value rounded to f32 (the f32 model's weight),
// so an f64 model is the exact-arithmetic twin of the f32 model from the same seed.
void store_param(const tensor_slot& slot, const tensor& values);
// `values` into the slot's bound parameter, rounded once to its dtype.
void store_param_as_is(const tensor_slot& slot, const tensor& values);

// ---- helpers for layer code ------------------------------------------------------------------

// t.describe(), or "undefined", for error messages.
std::string describe(const tensor& t);
// `s` with its last extent replaced.
shape with_last(shape s, std::int64_t last);
// Product of all extents but the last (1 for rank 0).
std::int64_t leading_rows(const shape& s);

// A contiguous view of the first numel(sizes) elements of a planned buffer, shaped `sizes`.
// Fails naming `layer` and `what` when the buffer is not bound or is too small for the batch.
tensor planned_view(const tensor& planned, const shape& sizes, std::string_view layer,
                    std::string_view what);

}  // namespace troupe::models
