// kv_cache: the keys and values of every layer for incremental decoding, and the attention step
// that reads and extends them.
//
// Generation runs the prompt once and then one token (or a few) at a time. Each attention layer
// projects only the new positions, rotates q and k at their absolute positions (start..start+t-1),
// appends k and v to its cache and attends over every cached position (ops::attention with S > T:
// query i sees keys s <= start + i). The cache is planned once, when generation begins, as one
// arena of per-layer [B, capacity, Hkv, D] tensors; steps do not allocate.
//
//   kv_cache cache(n_layer, {.batch = B, .capacity = T_max, .n_kv_head = Hkv, .head_dim = D},
//                  dtype::f32, dev);
//   attention_step(attn, x, y, cache.layer(i), cache.length());  // per layer
//   cache.advance(t);                                             // after all layers
//
// attention_step reuses the attention layer's planned activations and scratch as its buffers, so
// a step overwrites what the last training forward saved: run forward again before backward.
#pragma once

#include <cstdint>
#include <vector>

#include "models/layers/attention.hpp"
#include "models/layers/slots.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models {

struct kv_cache_dims {
  std::int64_t batch = 1;
  std::int64_t capacity = 1;  // positions it can hold (prompt plus generated)
  std::int64_t n_kv_head = 1;
  std::int64_t head_dim = 1;
};

// The cached keys and values of one layer, [B, capacity, Hkv, D] each.
struct kv_layer {
  tensor k, v;
};

class kv_cache {
 public:
  kv_cache(std::int64_t n_layer, const kv_cache_dims& dims, dtype t, device dev);
  kv_cache(const kv_cache&) = delete;
  kv_cache& operator=(const kv_cache&) = delete;

  const kv_cache_dims& dims() const { return dims_; }
  const kv_layer& layer(std::int64_t i) const { return layers_.at(static_cast<std::size_t>(i)); }
  std::int64_t length() const { return length_; }  // positions filled so far
  // Checks that t more positions fit (call before a step, naming `who` in the error).
  void check_room(std::int64_t t, const char* who) const;
  void advance(std::int64_t t);  // after every layer has appended t positions
  void clear() { length_ = 0; }
  std::size_t bytes() const { return mem_.activation_bytes(); }

 private:
  kv_cache_dims dims_;
  std::vector<kv_layer> layers_;
  std::int64_t length_ = 0;
  slot_list slots_;
  layer_memory mem_;
};

// y = attn(x) for x [B, t, C] at positions start..start+t-1, attending over the cached positions
// 0..start-1 and the new ones, whose k and v are appended to `cache` at start..start+t-1.
void attention_step(attention& attn, const tensor& x, const tensor& y, const kv_layer& cache,
                    std::int64_t start);

// attention_step as a layer (forward only), for a block's composition (models/layers/residual.hpp).
struct cached_attention {
  attention& attn;
  const kv_layer& cache;
  std::int64_t start;
  void forward(const tensor& x, const tensor& y) const { attention_step(attn, x, y, cache, start); }
};

}  // namespace troupe::models
