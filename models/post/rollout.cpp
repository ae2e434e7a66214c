// rollout: batched group sampling with the kv cache (rollout.hpp).
#include "models/post/rollout.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

std::int64_t rollout_rows::new_tokens() const {
  std::int64_t n = 0;
  for (auto l : lengths) n += l;
  return n;
}

rollout_rows sample_completions(causal_lm& model, std::span<const std::int32_t> prompts,
                                std::int64_t prompt_len, const rollout_options& opt) {
  TROUPE_CHECK(prompt_len > 0 && !prompts.empty() &&
                   prompts.size() % static_cast<std::size_t>(prompt_len) == 0,
               "rollout: ", prompts.size(), " prompt tokens are not prompts of ", prompt_len);
  TROUPE_CHECK(opt.group > 0 && opt.max_new > 0, "rollout: group ", opt.group, " and max_new ",
               opt.max_new, " must be > 0");
  const std::int64_t n = static_cast<std::int64_t>(prompts.size()) / prompt_len;
  rollout_rows out;
  out.rows = n * opt.group;
  out.prompt_len = prompt_len;
  out.seq = prompt_len + opt.max_new;
  TROUPE_CHECK(out.seq <= model.max_seq(), "rollout: prompts of ", prompt_len, " and max_new ",
               opt.max_new, " need ", out.seq, " positions; the model holds ", model.max_seq());
  for (auto id : prompts)
    TROUPE_CHECK(id >= 0 && id < model.vocab(), "rollout: prompt token ", id,
                 " is outside the model's vocabulary of ", model.vocab());
  const auto seq = static_cast<std::size_t>(out.seq), p = static_cast<std::size_t>(prompt_len);
  out.ids.assign(static_cast<std::size_t>(out.rows) * seq, opt.eos < 0 ? 0 : opt.eos);
  out.targets.assign(out.ids.size(), -100);
  out.lengths.assign(static_cast<std::size_t>(out.rows), 0);
  std::vector<std::int32_t> step(static_cast<std::size_t>(out.rows) * p);
  for (std::int64_t r = 0; r < out.rows; ++r) {
    const auto* src = prompts.data() + (r / opt.group) * prompt_len;
    std::copy(src, src + prompt_len, out.ids.begin() + static_cast<std::ptrdiff_t>(r * out.seq));
    std::copy(src, src + prompt_len, step.begin() + static_cast<std::ptrdiff_t>(r * prompt_len));
  }
  model.begin_generation(out.rows, out.seq);
  token_sampler sampler(opt.sampling, opt.seed);
  std::vector<bool> done(static_cast<std::size_t>(out.rows), false);
  tensor logits =
      model.step_logits(tensor(step.data(), step.size() * 4, dtype::i32, {out.rows, prompt_len}));
  const auto v = static_cast<std::size_t>(model.vocab());
  for (std::int64_t k = 0; k < opt.max_new; ++k) {
    owned_tensor host, f32;  // the sampler reads f32 on the host
    if (!logits.is_cpu()) host = to_device(logits, device::cpu());
    const tensor& src = logits.is_cpu() ? logits : host;
    if (src.type() != dtype::f32) {
      f32 = empty(src.sizes(), dtype::f32);
      ops::copy(src, f32);
    }
    const float* rows = src.type() == dtype::f32 ? src.data_as<float>() : f32.data_as<float>();
    step.resize(static_cast<std::size_t>(out.rows));
    bool all_done = true;
    for (std::int64_t r = 0; r < out.rows; ++r) {
      const auto ru = static_cast<std::size_t>(r);
      const std::size_t at = ru * seq + p + static_cast<std::size_t>(k);
      if (done[ru]) {
        step[ru] = out.ids[at];  // eos padding: decoded but never trained on
        continue;
      }
      const std::int32_t id = sampler.next({rows + ru * v, v});
      out.ids[at] = id;
      out.targets[at - 1] = id;  // position at - 1 predicts it
      ++out.lengths[ru];
      step[ru] = id;
      done[ru] = id == opt.eos;
      all_done = all_done && done[ru];
    }
    if (all_done || k + 1 == opt.max_new) break;
    logits = model.step_logits(tensor(step.data(), step.size() * 4, dtype::i32, {out.rows, 1}));
  }
  return out;
}

}  // namespace troupe::models
