// A tensor shard's kv-cache decoding (see tp_generation.hpp).
#include "models/parallel/tp_generation.hpp"

#include <algorithm>

#include "memory/error.hpp"

namespace troupe::models {

tp_generation::tp_generation(const tp_generation_plan& p, tp_group tp)
    : plan_(p),
      tp_(tp),
      cache_(p.n_layer,
             {.batch = p.batch,
              .capacity = p.capacity,
              .n_kv_head = p.n_kv_head,
              .head_dim = p.head_dim},
             dtype::f32, device::cpu()),
      ids_(empty({p.batch * p.rows}, dtype::i32)),
      local_(
          empty({p.batch * divide_by_tp(p.vocab, tp.size(), "tp_generation: vocab")}, dtype::f32)),
      full_(empty({p.batch, p.vocab}, dtype::f32)),
      scratch_(empty({p.batch * p.vocab}, dtype::f32)) {
  TROUPE_CHECK(p.rows > 0 && p.max_step > 0, "tp_generation: rows and max_step must be > 0");
}

void begin_tp_generation(std::unique_ptr<tp_generation>& gen, tp_generation_plan p,
                         const tp_group& tp, std::string_view who) {
  if (p.capacity == 0) p.capacity = p.max_seq;
  TROUPE_CHECK(p.batch > 0 && p.batch <= p.max_batch, who, ": generation batch ", p.batch,
               " must be in 1..", p.max_batch, " (the planned batch)");
  TROUPE_CHECK(p.capacity > 0 && p.capacity <= p.max_seq, who, ": generation capacity ", p.capacity,
               " must be in 1..", p.max_seq, " (max_seq)");
  if (gen && gen->plan().batch == p.batch && gen->plan().capacity == p.capacity) {
    gen->clear();
    return;
  }
  gen.reset();  // free the old cache before planning the new one
  gen = std::make_unique<tp_generation>(p, tp);
}

std::int64_t tp_generation::run(
    const tensor& ids, std::string_view who,
    const std::function<void(const tensor& ids, std::int64_t start)>& pass) {
  TROUPE_CHECK(ids.defined() && ids.dim() == 2 && ids.type() == dtype::i32 && ids.is_cpu(), who,
               ": ids must be i32 [B, t] on the host, got ", describe(ids));
  const std::int64_t b = ids.size(0), t = ids.size(1);
  TROUPE_CHECK(b <= plan_.batch && t <= plan_.max_step, who, ": step [", b, ", ", t,
               "] exceeds the generation batch ", plan_.batch, " or the planned seq ",
               plan_.max_step);
  cache_.check_room(t, std::string(who).c_str());
  std::int64_t n = 0;
  for (std::int64_t first = 0; first < t; first += n) {
    n = std::min(plan_.rows, t - first);
    tensor part = ids.narrow(1, first, n);
    if (!part.is_contiguous()) {  // the embeddings read ids as one run
      tensor dst = ids_.narrow(0, 0, b * n).reshape({b, n});
      const std::int32_t* src = part.data_as<std::int32_t>();
      std::int32_t* out = dst.data_as<std::int32_t>();
      for (std::int64_t r = 0; r < b; ++r)
        for (std::int64_t i = 0; i < n; ++i)
          out[r * n + i] = src[r * part.stride(0) + i * part.stride(1)];
      part = dst;
    }
    pass(part, cache_.length());
    cache_.advance(n);
  }
  return n;
}

tensor tp_generation::local_logits(std::int64_t b) const {
  const std::int64_t lv = plan_.vocab / tp_.size();
  return local_.narrow(0, 0, b * lv).reshape({b, lv});
}

tensor tp_generation::gather(std::int64_t b) {
  tensor out = full_logits(b);
  gather_last_dim(tp_, local_logits(b), out, scratch_);
  return out;
}

}  // namespace troupe::models
