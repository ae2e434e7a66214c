// Optimizer steps over a model's flat parameter and gradient buffers.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "tensor/ops.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

class slot_list;
struct tensor_slot;

// The factor torch.nn.utils.clip_grad_norm_ scales gradients of global L2 norm `norm` by:
// max_norm / (norm + 1e-6) when the norm exceeds max_norm, else 1 (max_norm <= 0: no clipping).
// Every trainer clips with it, whichever way it sums the norm (one buffer, shards, chunks).
double clip_factor(double norm, double max_norm);

// clip_factor over one flat gradient buffer: returns the global L2 norm before clipping and scales
// the gradients by the factor.
double clip_grad_norm(const tensor& grads, double max_norm);

// torch.optim.AdamW over one flat parameter buffer, with its moments m and v held here.
class adamw_optimizer {
 public:
  adamw_optimizer(const tensor& params, const ops::adamw_options& opt);
  // Applies weight decay 0 to the parameters of `slots` (whose values live in `params`) for which
  // `no_decay(name, rank)` holds; by default (torch's AdamW) every parameter decays.
  void exempt_from_decay(const slot_list& slots, const tensor& params,
                         bool (*no_decay)(const tensor_slot& parameter));
  // One update with learning rate lr (the schedule is the caller's); increments the step count.
  void step(const tensor& params, const tensor& grads, double lr);
  std::int64_t steps_taken() const { return step_; }
  void set_steps_taken(std::int64_t s) { step_ = s; }  // when resuming: m and v are loaded too
  const tensor& m() const { return m_; }
  const tensor& v() const { return v_; }

 private:
  struct segment {
    std::int64_t begin = 0, length = 0;
    bool decay = true;
  };
  ops::adamw_options opt_;
  owned_tensor m_, v_;
  std::vector<segment> segments_;  // covers the flat buffer; empty: one segment that decays
  std::int64_t step_ = 0;
};

// The usual exemption (nanoGPT, HF Trainer): biases and norm weights (rank < 2) and embedding
// tables (param_spec::embedding: wte, wpe, embed_tokens) do not decay.
bool biases_norms_embeddings(const tensor_slot& parameter);

// Learning rate at `step` (0-based): linear warmup over `warmup` steps to `lr`, then cosine decay
// to `min_lr` at `total` steps.
double warmup_cosine_lr(std::int64_t step, std::int64_t warmup, std::int64_t total, double lr,
                        double min_lr);

}  // namespace troupe::models
