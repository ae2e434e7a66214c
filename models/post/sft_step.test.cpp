// SFT steps through the trainer: accumulated micro-batches give the step of one batch of the same
// rows, with the loss averaged over the step's assistant tokens.
#include <catch2/catch.hpp>

#include "models/llama.hpp"
#include "models/post/sft_step.hpp"

using namespace troupe;
using namespace troupe::models;

TEST_CASE("SFT micro-batches accumulate to the step of one batch of their rows", "[cpu]") {
  auto chat = [](std::vector<std::int32_t> ids, std::vector<std::uint8_t> trained) {
    return tokenized_chat{std::move(ids), std::move(trained)};
  };
  // One per row: 2 and 4 assistant targets, so the mean of the two rows' means (1/2 each) is
  // not the mean over the 6 tokens (1/3 and 2/3).
  const std::vector<tokenized_chat> chats{chat({1, 2, 3, 4, 5}, {0, 0, 1, 1, 0}),
                                          chat({6, 7, 8, 9, 10}, {0, 1, 1, 1, 1})};
  auto rows = std::make_shared<sft_rows>(pack_chats(chats, {.seq = 8, .pack = false}));
  const llama_config lc{.vocab = 23,
                        .dim = 16,
                        .n_layer = 2,
                        .n_head = 4,
                        .n_kv_head = 2,
                        .hidden = 24,
                        .max_seq = 8};
  auto step_with = [&](std::int64_t batch, std::int64_t accum) {
    causal_lm_of<llama> m(lc, batch_dims{batch, 8}, dtype::f64);
    m.init_weights(1);
    train_config cfg;
    cfg.precision = "f64";
    cfg.batch = batch;
    cfg.seq = 8;
    cfg.grad_accum = accum;
    cfg.steps = 1;
    cfg.warmup = 0;
    trainer tr(m, cfg);
    const step_result r = tr.step(sft_micro_batch(rows, batch, accum));
    const tensor& p = m.memory().params();
    return std::pair{r, std::vector<double>(p.data_as<double>(), p.data_as<double>() + p.numel())};
  };
  const auto [one, w1] = step_with(2, 1);
  const auto [two, w2] = step_with(1, 2);
  // f64: the same terms in another order (~1e-16 relative); a mean of means would differ in the
  // loss by O(1e-1) and in the gradient norm by O(1e-2) relative.
  CHECK(two.loss == Approx(one.loss).epsilon(1e-12));
  CHECK(two.grad_norm == Approx(one.grad_norm).epsilon(1e-10));
  double worst = 0;
  for (std::size_t i = 0; i < w1.size(); ++i) worst = std::max(worst, std::abs(w1[i] - w2[i]));
  CHECK(worst < 1e-12);  // AdamW's first step moves every weight by ~lr = 3e-3
}
