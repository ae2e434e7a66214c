// deferred_weight_grads: weight gradients put off for later, for pipeline schedules that split a
// backward into the gradient of its input (B, sent upstream at once) and of its weights (W, run
// when the stage would otherwise wait; scheduler/pipeline.hpp's zero-bubble schedule).
//
// While a deferred_weight_grads::scope is alive on a thread, linear::backward on that thread
// computes dx only and queues dW += dy^T x and db += sum_rows(dy), with copies of its dy and x
// (the dy is scratch the next layer overwrites, and x lives in activations a later forward
// reuses). mark(block) records a block boundary (where the block's weight gradients are complete
// once run() reaches it). run() computes the queued gradients in the order they were queued, with
// the same kernels linear::backward uses, so a parameter's gradient gets the same sum in the same
// order as without deferral, and calls at_mark at each mark. Other layers' parameter gradients
// (norms, embeddings, heads) are computed in B as usual. The copies' buffers are kept for the next
// microbatch (same layers, same shapes): no allocation in the steady state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::models {

class deferred_weight_grads {
 public:
  // Installs q as the calling thread's queue for the scope's lifetime (scopes nest).
  class scope {
   public:
    explicit scope(deferred_weight_grads& q);
    ~scope();
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    deferred_weight_grads* prev_;
  };
  // The calling thread's queue, or null.
  static deferred_weight_grads* active();

  // Queues dweight += dy^T x (and dbias += sum_rows(dy) when dbias is defined); dy [n, out] and
  // x [n, in] are copied.
  void add(const tensor& dweight, const tensor& dbias, const tensor& dy, const tensor& x);
  void mark(std::int64_t block);
  // Computes everything queued, in order, calling at_mark (may be empty) at each mark; the queue is
  // empty afterwards (its buffers are kept).
  void run(const std::function<void(std::int64_t block)>& at_mark);
  // Forgets what is queued (a failed step).
  void clear() {
    items_.clear();
    used_ = 0;
  }
  bool empty() const { return items_.empty(); }
  // Bytes of the copies' buffers.
  std::size_t buffer_bytes() const;

 private:
  struct item {
    tensor dweight, dbias;      // dbias undefined: no bias; both undefined: a mark
    std::size_t dy = 0, x = 0;  // buffers_ entries
    std::int64_t block = -1;
  };
  std::size_t copy(const tensor& t);

  std::vector<item> items_;
  std::vector<owned_tensor> buffers_;  // reused in order: entry k holds the k-th copy
  std::size_t used_ = 0;
};

}  // namespace troupe::models
