// Generation through pipeline stages (see pipeline_generation.hpp).
#include "models/parallel/pipeline_generation.hpp"

#include <utility>

#include "memory/error.hpp"

namespace troupe::models::parallel {

pipeline_generator::pipeline_generator(pipeline_stage& stage, collective::communicator& pp,
                                       std::int64_t dim)
    : stage_(stage), pp_(pp), dim_(dim) {
  TROUPE_CHECK(pp.size() == stage.stages() && pp.rank() == stage.stage(),
               "pipeline_generator: the pp communicator (rank ", pp.rank(), " of ", pp.size(),
               ") must hold the stages in order (stage ", stage.stage(), " of ", stage.stages(),
               ")");
}

void pipeline_generator::begin_generation(std::int64_t batch, std::int64_t capacity) {
  stage_.begin_generation(batch, capacity);
  const tp_generation_plan& p = stage_.generation().plan();
  if (in_.numel() != p.batch * p.rows * dim_) {
    in_ = empty({p.batch * p.rows * dim_}, dtype::f32);
    out_ = empty({p.batch * p.rows * dim_}, dtype::f32);
  }
  length_ = 0;
}

tensor pipeline_generator::step_logits(const tensor& ids) {
  tp_generation& g = stage_.generation();
  const int p = stage_.stages(), me = stage_.stage();
  const int parts = p * stage_.chunks();
  const std::int64_t b = ids.dim() == 2 ? ids.size(0) : 0;
  g.run(ids, "pipeline_generator", [&](const tensor& part, std::int64_t start) {
    const std::int64_t n = part.size(1);
    auto view = [&](const owned_tensor& buf) {
      return buf.narrow(0, 0, b * n * dim_).reshape({b, n, dim_});
    };
    tensor in = view(in_), out = view(out_);
    for (int k = me; k < parts; k += p) {  // this rank's virtual stages, in order
      const int c = k / p;
      if (k > 0 && p > 1) pp_.recv(in.data(), in.numel(), dtype::f32, (k - 1) % p).wait();
      const bool last = k + 1 == parts;
      stage_.step_chunk(c, k == 0 ? part : in, last ? tensor{} : out, start);
      if (last) continue;
      if (p > 1)
        pp_.send(out.data(), out.numel(), dtype::f32, (k + 1) % p).wait();
      else
        std::swap(in, out);  // one stage: the next chunk is this rank's too
    }
  });
  length_ = g.length();
  const int owner = (parts - 1) % p;  // the last virtual stage's rank
  if (me == owner) {
    tensor logits = g.gather(b);
    for (int s = 0; s < p; ++s)
      if (s != me) pp_.send(logits.data(), logits.numel(), dtype::f32, s).wait();
    return logits;
  }
  tensor logits = g.full_logits(b);
  pp_.recv(logits.data(), logits.numel(), dtype::f32, owner).wait();
  return logits;
}

}  // namespace troupe::models::parallel
