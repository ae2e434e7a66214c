// DPO on the trunk: the gradient one micro-batch backpropagates (per-sequence weights into the
// head's cross-entropy) equals central differences of the DPO loss through the whole model, for
// sigmoid DPO with label smoothing and for IPO; preference data and its errors; the SFT
// micro-batch's loss is the plain cross-entropy on the assistant positions alone.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <filesystem>
#include <fstream>

#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "models/post/central_differences.test.hpp"
#include "models/post/dpo_step.hpp"
#include "models/post/sft_step.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

llama_config tiny() {
  return {.vocab = 23,
          .dim = 16,
          .n_layer = 2,
          .n_head = 4,
          .n_kv_head = 2,
          .hidden = 24,
          .max_seq = 16};
}

// Two pairs of 8 tokens: a 3-token prompt, then the response.
std::shared_ptr<preference_rows> random_pairs() {
  auto rows = std::make_shared<preference_rows>();
  rows->seq = 8;
  testing::rng g(9);
  for (int r = 0; r < 4; ++r) {
    std::vector<std::int32_t> ids(8);
    for (auto& x : ids) x = static_cast<std::int32_t>(g.integer(0, 22));
    const std::int64_t len = 6 + r % 3;  // responses of other lengths, then padding
    for (std::int64_t i = 0; i < 8; ++i) {
      rows->ids.push_back(i < len ? ids[i] : 0);
      rows->targets.push_back(i >= 2 && i + 1 < len ? ids[i + 1] : -100);
    }
  }
  return rows;
}

struct temp_file {
  std::filesystem::path path;
  explicit temp_file(const std::string& text) {
    static int n = 0;
    path = std::filesystem::temp_directory_path() /
           ("troupe-pref-" + std::to_string(::getpid()) + "-" + std::to_string(n++) + ".jsonl");
    std::ofstream(path) << text;
  }
  ~temp_file() { std::filesystem::remove(path); }
};

}  // namespace

TEST_CASE("a DPO micro-batch backpropagates the gradient of the DPO loss", "[cpu]") {
  const auto rows = random_pairs();
  for (const dpo_options opt :
       {dpo_options{.type = dpo_loss_type::sigmoid, .beta = 0.5, .label_smoothing = 0.1},
        dpo_options{.type = dpo_loss_type::ipo, .beta = 0.3}}) {
    INFO((opt.type == dpo_loss_type::ipo ? "ipo" : "sigmoid"));
    causal_lm_of<llama> policy(tiny(), batch_dims{4, 8}, dtype::f64);
    causal_lm_of<llama> reference(tiny(), batch_dims{4, 8}, dtype::f64);
    policy.init_weights(4);
    reference.init_weights(3);  // another model: the log-ratios are not zero
    policy.memory().zero_grads();
    dpo_result seen;
    const auto run =
        dpo_micro_batch(rows, reference, 2, opt, [&](const dpo_result& r) { seen = r; });
    const double loss = run(policy, 0, 1.0);
    CHECK(loss == seen.loss);
    CHECK(seen.margin == Approx(seen.rewards_chosen - seen.rewards_rejected));
    const tensor& g = policy.memory().grads();
    const tensor& p = policy.memory().params();

    std::vector<std::int32_t> id_rows, target_rows;  // draw 0: chosen rows, then rejected
    preference_batch(*rows, 0, 2, id_rows, target_rows);
    tensor ids(id_rows.data(), id_rows.size() * 4, dtype::i32, {4, 8});
    tensor targets(target_rows.data(), target_rows.size() * 4, dtype::i32, {4, 8});
    auto loss_at = [&]() {
      dpo_result r;
      std::vector<std::int64_t> counts;
      return dpo_forward(policy, reference, ids, targets, opt, r, counts);
    };
    CHECK(loss_at() == Approx(loss).epsilon(1e-14));
    // f64 central differences (central_differences.test.hpp): a missing or misweighted sequence
    // changes a gradient by O(its size).
    testing::rng pick(2);
    std::vector<std::int64_t> at;
    for (int k = 0; k < 40; ++k) at.push_back(pick.integer(0, p.numel() - 1));
    testing::check_central_differences(p, g, at, loss_at);
  }
}

TEST_CASE("preference pairs become chosen and rejected rows with response targets", "[cpu]") {
  temp_file f(R"({"prompt": "ab", "chosen": "cd", "rejected": "e"})"
              "\n"
              R"({"prompt": [{"role": "user", "content": "q"}],)"
              R"( "chosen": [{"role": "assistant", "content": "yes"}],)"
              R"( "rejected": [{"role": "assistant", "content": "no"}]})"
              "\n");
  auto tok = make_byte_tokenizer();
  const auto sp = chat_specials::appended(chat_format::chatml, 256);
  auto rows =
      read_preference_jsonl(f.path.string(), *tok, sp, {.format = chat_format::chatml, .seq = 32});
  REQUIRE(rows.has_value());
  REQUIRE(rows->pairs() == 2);
  const std::int32_t x = -100;
  // "abcd": targets c, d at positions 1, 2 (the byte tokenizer has no eos).
  CHECK(std::vector<std::int32_t>(rows->targets.begin(), rows->targets.begin() + 5) ==
        std::vector<std::int32_t>{x, 'c', 'd', x, x});
  CHECK(rows->targets[32 + 1] == 'e');
  // Conversational: the response is "yes" and <|im_end|> after "<|im_start|>assistant\n".
  std::int64_t n = 0;
  for (std::int64_t i = 64; i < 96; ++i) n += rows->targets[i] != x;
  CHECK(n == 4);
  std::vector<std::int32_t> ids, targets;
  preference_batch(*rows, 1, 2, ids, targets);  // draw 1: pairs 2 % 2 = 0 and 3 % 2 = 1
  CHECK(std::equal(ids.begin(), ids.begin() + 32, rows->ids.begin()));            // 0 chosen
  CHECK(std::equal(ids.begin() + 32, ids.begin() + 64, rows->ids.begin() + 64));  // 1 chosen
  CHECK(std::equal(ids.begin() + 64, ids.begin() + 96, rows->ids.begin() + 32));  // 0 rejected
}

TEST_CASE("bad preference data is refused naming the file and line", "[cpu][faults]") {
  auto tok = make_byte_tokenizer();
  const auto sp = chat_specials::appended(chat_format::chatml, 256);
  const std::string ok = R"({"prompt": "a", "chosen": "b", "rejected": "c"})";
  struct bad_case {
    std::string line, what;
  };
  for (const bad_case& c : std::vector<bad_case>{
           {R"({"prompt": "a", "chosen": "b"})", "no \"rejected\""},
           {R"({"prompt": "a", "chosen": "b", "rejected": )", "not valid JSON"},
           {R"({"prompt": "a", "chosen": [], "rejected": "c"})", "must both be strings"},
           {R"({"prompt": "a", "chosen": "a very long answer indeed", "rejected": "c"})",
            "longer than the sequence length 16"}}) {
    temp_file f(ok + "\n" + c.line + "\n");
    auto rows = read_preference_jsonl(f.path.string(), *tok, sp, {.format = {}, .seq = 16});
    REQUIRE_FALSE(rows.has_value());
    CHECK_THAT(rows.error_message(),
               Catch::Contains(f.path.string() + ":2: ") && Catch::Contains(c.what));
    std::printf("faults: preference line %s -> refused: %s\n", c.line.c_str(),
                rows.error_message().c_str());
  }
}

TEST_CASE("the SFT loss is the plain cross-entropy of the assistant positions alone", "[cpu]") {
  auto chat = [](std::vector<std::int32_t> ids, std::vector<std::uint8_t> trained) {
    return tokenized_chat{std::move(ids), std::move(trained)};
  };
  const std::vector<tokenized_chat> chats{chat({1, 2, 3, 4, 5}, {0, 0, 1, 1, 0}),
                                          chat({6, 7, 8, 9}, {0, 1, 1, 1}),
                                          chat({10, 11, 12}, {0, 0, 1})};
  auto rows = std::make_shared<sft_rows>(pack_chats(chats, {.seq = 8}));
  REQUIRE(rows->rows() == 2);
  causal_lm_of<llama> m(tiny(), batch_dims{2, 8}, dtype::f64);
  m.init_weights(1);
  const double loss = sft_micro_batch(rows, 2)(m, 0, 1.0);
  // The same rows forward again; the plain cross-entropy at every position, averaged over the
  // assistant positions only (plain loops over the logits).
  tensor ids(rows->ids.data(), rows->ids.size() * 4, dtype::i32, {2, 8});
  tensor tg(rows->targets.data(), rows->targets.size() * 4, dtype::i32, {2, 8});
  tensor seg(rows->segments.data(), rows->segments.size() * 4, dtype::i32, {2, 8});
  tensor pos(rows->positions.data(), rows->positions.size() * 4, dtype::i32, {2, 8});
  REQUIRE(m.set_packing(seg, pos));
  m.forward(ids, tg);
  const tensor logits = m.logits();
  double sum = 0;
  int n = 0;
  for (std::int64_t r = 0; r < 16; ++r) {
    const std::int32_t y = rows->targets[static_cast<std::size_t>(r)];
    if (y == -100) continue;
    const double* row = logits.data_as<double>() + r * 23;
    double mx = *std::max_element(row, row + 23), z = 0;
    for (int k = 0; k < 23; ++k) z += std::exp(row[k] - mx);
    sum += mx + std::log(z) - row[y];
    ++n;
  }
  CHECK(n == 6);                                  // 3, 4 | 7, 8, 9 | 12
  CHECK(loss == Approx(sum / n).epsilon(1e-13));  // f64: the same terms, other order
}
