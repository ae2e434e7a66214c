// streamed_model (see streamed_model.hpp): the activations and scratch of the streamed placement,
// and its construction for each family.
#include "models/offload/streamed_model.hpp"

#include <variant>

#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/families.hpp"

namespace troupe::models {

memory::arena bind_planned(const slot_list& slots, slot_kind kind, dtype t) {
  TROUPE_CHECK(t == dtype::f32 || t == dtype::bf16, "streamed_model: f32 or bf16, got ",
               dtype_name(t));
  const std::size_t elem = dtype_size(t);
  std::vector<memory::size_spec> specs;
  for (const auto& s : slots.slots())
    if (s.kind == kind)
      specs.push_back(
          {s.name, static_cast<std::size_t>(s.sizes.numel()) * elem, 64, s.first, s.last});
  if (specs.empty()) return {};
  memory::arena a(memory::plan_memory(specs), 0, memory::tier::host);
  for (const auto& s : slots.slots())
    if (s.kind == kind)
      *s.field = tensor(a.at(s.name), static_cast<std::size_t>(s.sizes.numel()) * elem, t, s.sizes,
                        device::cpu());
  return a;
}

std::unique_ptr<streamed_model> make_streamed_model(const gpt_config& cfg, batch_dims dims,
                                                    dtype t) {
  TROUPE_CHECK(!cfg.unbound, "streamed_model: an unbound config binds nothing to stream");
  return std::make_unique<streamed<gpt_family>>(cfg, dims, t);
}

std::unique_ptr<streamed_model> make_streamed_model(const llama_config& cfg, batch_dims dims,
                                                    dtype t) {
  TROUPE_CHECK(!cfg.unbound, "streamed_model: an unbound config binds nothing to stream");
  return std::make_unique<streamed<llama_family>>(cfg, dims, t);
}

std::unique_ptr<streamed_model> make_streamed_model(const moe_config& cfg, batch_dims dims,
                                                    dtype t) {
  TROUPE_CHECK(!cfg.unbound, "streamed_model: an unbound config binds nothing to stream");
  return std::make_unique<streamed<moe_family>>(cfg, dims, t);
}

std::unique_ptr<streamed_model> make_streamed_model(const hf::model_config& cfg, batch_dims dims,
                                                    bool recompute, dtype t) {
  return with_family(cfg, [&](auto, auto c) {
    c.recompute = recompute;
    return make_streamed_model(c, dims, t);
  });
}

}  // namespace troupe::models
