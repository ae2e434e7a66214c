// deferred_weight_grads: the queue and its thread's scope (see weight_grads.hpp).
#include "models/layers/weight_grads.hpp"

#include "memory/error.hpp"
#include "models/layers/slots.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

namespace {
thread_local deferred_weight_grads* active_queue = nullptr;
}  // namespace

deferred_weight_grads::scope::scope(deferred_weight_grads& q) : prev_(active_queue) {
  active_queue = &q;
}

deferred_weight_grads::scope::~scope() {
  active_queue = prev_;
}

deferred_weight_grads* deferred_weight_grads::active() {
  return active_queue;
}

std::size_t deferred_weight_grads::copy(const tensor& t) {
  const std::size_t k = used_++;
  if (k == buffers_.size()) buffers_.push_back(owned_tensor{});
  auto& b = buffers_[k];
  if (!b.defined() || b.sizes() != t.sizes() || b.type() != t.type())
    b = troupe::empty(t.sizes(), t.type(), t.dev());
  ops::copy(t, b);
  return k;
}

void deferred_weight_grads::add(const tensor& dweight, const tensor& dbias, const tensor& dy,
                                const tensor& x) {
  TROUPE_CHECK(dweight.defined() && dy.dim() == 2 && x.dim() == 2 && dy.size(0) == x.size(0) &&
                   dweight.sizes() == shape({dy.size(1), x.size(1)}),
               "deferred_weight_grads: dy ", describe(dy), " and x ", describe(x),
               " do not make the weight gradient ", describe(dweight));
  item it;
  it.dweight = dweight;
  it.dbias = dbias;
  it.dy = copy(dy);
  it.x = copy(x);
  items_.push_back(std::move(it));
}

void deferred_weight_grads::mark(std::int64_t block) {
  item it;
  it.block = block;
  items_.push_back(std::move(it));
}

void deferred_weight_grads::run(const std::function<void(std::int64_t block)>& at_mark) {
  for (const auto& it : items_) {
    if (!it.dweight.defined()) {
      if (at_mark) at_mark(it.block);
      continue;
    }
    const tensor& dy = buffers_[it.dy];
    ops::matmul(dy.transpose(0, 1), buffers_[it.x], it.dweight, 1.0, 1.0);
    if (it.dbias.defined()) ops::sum_rows(dy, it.dbias);
  }
  items_.clear();
  used_ = 0;  // the next microbatch reuses the buffers from the start
}

std::size_t deferred_weight_grads::buffer_bytes() const {
  std::size_t n = 0;
  for (const auto& b : buffers_) n += b.defined() ? b.nbytes() : 0;
  return n;
}

}  // namespace troupe::models
