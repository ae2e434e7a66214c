// families: the one place where an HF config (models/hf/config.hpp) picks its model family.
//
//   with_family(cfg, [&](auto family, auto c) { using F = typename decltype(family)::type; ... })
//
// calls the function with the family's tag (F: gpt_family, llama_family, moe_family, each a
// trunk_family of models/trunk.hpp with F::model its whole model) and F's config made from the HF
// one, and returns what it returns (the same type for every family). Code that builds a model, a
// shard or a stage of any family goes through here, so adding a family adds a line here, not a
// branch in every placement.
#pragma once

#include <variant>

#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/hf/config.hpp"
#include "models/llama.hpp"
#include "models/moe.hpp"

namespace troupe::models {

template <class F>
struct family_tag {
  using type = F;
};

template <class Fn>
decltype(auto) with_family(const hf::model_config& cfg, Fn&& f) {
  if (const auto* g = std::get_if<hf::gpt2_config>(&cfg))
    return f(family_tag<gpt_family>{}, hf::to_gpt_config(*g));
  if (const auto* m = std::get_if<hf::moe_config>(&cfg))
    return f(family_tag<moe_family>{}, to_moe_config(*m));
  return f(family_tag<llama_family>{}, to_llama_config(std::get<hf::llama_config>(cfg)));
}

}  // namespace troupe::models
