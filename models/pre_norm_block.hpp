// pre_norm_block: what every family's whole-model block does with its four parts, written once.
//
//   r = x + attn(norm_1(x)); y = r + ff(norm_2(r))      (models/layers/residual.hpp)
//
// A family's block (gpt_block, llama_block, moe_block) holds its parts under HF's names, derives
// from pre_norm_block<itself> and gives three things: parts(), its four parts in that order as a
// tuple of references (std::tie); part_names, the names its parameters are declared under; and
// label, for errors. The base declares them (with the block's activation buffers `buf`), runs
// forward, recompute and backward, and one decoding step over a kv cache. A new family whose
// block is norm + attention + feed-forward with residuals writes only its constructor.
#pragma once

#include <cstdint>
#include <string_view>

#include "models/kv_cache.hpp"
#include "models/layers/residual.hpp"
#include "models/layers/slots.hpp"

namespace troupe::models {

template <class Block>
struct pre_norm_block {
  // recompute: the block's activations live in a recomputed scope (see slots.hpp), shared with
  // the other recomputed blocks; call recompute(x) before backward.
  void declare(slot_list& s, std::string_view name, batch_dims b, bool recompute = false) {
    auto scope = recompute ? s.enter_recomputed(name) : s.enter(name);
    auto [norm_1, attn, norm_2, ff] = self().parts();
    norm_1.declare(s, Block::part_names[0], b);
    attn.declare(s, Block::part_names[1], b);
    norm_2.declare(s, Block::part_names[2], b);
    ff.declare(s, Block::part_names[3], b);
    self().buf.declare(s, {b.batch, b.seq, norm_1.cfg.dim});
  }
  void forward(const tensor& x, const tensor& y) { run(x, y, nullptr, 0); }
  // forward again from the same x without writing y: restores what backward reads.
  void recompute(const tensor& x) { run(x, tensor{}, nullptr, 0); }
  void backward(const tensor& dy, const tensor& dx) {  // dx may alias dy
    auto [norm_1, attn, norm_2, ff] = self().parts();
    residual_backward(norm_1, attn, norm_2, ff, self().buf, dy, dx, Block::label);
  }
  // forward for new positions start.. with the attention over a kv cache (models/kv_cache.hpp).
  void forward_step(const tensor& x, const tensor& y, const kv_layer& cache, std::int64_t start) {
    run(x, y, &cache, start);
  }

 private:
  Block& self() { return static_cast<Block&>(*this); }
  void run(const tensor& x, const tensor& y, const kv_layer* cache, std::int64_t start) {
    auto [norm_1, attn, norm_2, ff] = self().parts();
    if (cache != nullptr) {
      cached_attention step{attn, *cache, start};
      residual_forward(norm_1, step, norm_2, ff, self().buf, x, y, Block::label);
    } else {
      residual_forward(norm_1, attn, norm_2, ff, self().buf, x, y, Block::label);
    }
  }
};

}  // namespace troupe::models
