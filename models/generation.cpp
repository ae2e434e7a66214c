#include "models/generation.hpp"

#include <algorithm>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

std::vector<std::int32_t> generate(causal_lm& model, std::span<const std::int32_t> prompt,
                                   std::int64_t max_new, token_sampler& sampler, std::int32_t eos,
                                   const std::function<void(std::int32_t)>& on_token) {
  TROUPE_CHECK(!prompt.empty(), "generate: the prompt is empty");
  const auto n = static_cast<std::int64_t>(prompt.size());
  TROUPE_CHECK(n < model.max_seq(), "generate: the prompt has ", n,
               " tokens but the model holds at most ", model.max_seq(), " positions");
  for (auto id : prompt)
    TROUPE_CHECK(id >= 0 && id < model.vocab(), "generate: prompt token ", id,
                 " is outside the model's vocabulary of ", model.vocab());
  const std::int64_t total = std::min(model.max_seq(), n + max_new);
  model.begin_generation(1, total);
  std::vector<std::int32_t> ids(prompt.begin(), prompt.end());
  std::vector<std::int32_t> out;
  tensor logits = model.step_logits(tensor(ids.data(), ids.size() * 4, dtype::i32, {1, n}));
  while (static_cast<std::int64_t>(ids.size()) < total) {
    // The sampler reads f32 on the host (16-bit or device logits are converted).
    owned_tensor host;
    if (!logits.is_cpu()) host = to_device(logits, device::cpu());
    const tensor& src = logits.is_cpu() ? logits : host;
    owned_tensor f32;
    if (src.type() != dtype::f32) {
      f32 = empty(src.sizes(), dtype::f32);
      ops::copy(src, f32);
    }
    const tensor& row = src.type() == dtype::f32 ? src : f32;
    std::int32_t next =
        sampler.next({row.data_as<float>(), static_cast<std::size_t>(model.vocab())});
    ids.push_back(next);
    out.push_back(next);
    if (on_token) on_token(next);
    if (next == eos || static_cast<std::int64_t>(ids.size()) >= total) break;
    logits = model.step_logits(tensor(&ids.back(), 4, dtype::i32, {1, 1}));
  }
  return out;
}

}  // namespace troupe::models
