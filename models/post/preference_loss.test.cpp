// Preference losses against a PyTorch reference written from TRL's formulas
// (tests/fixtures/post/preference_losses.json, scripts/reference/make_post_fixtures.py: float64
// with autograd), and the per-sequence log-probabilities against plain loops and finite
// differences.
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "models/layers/testing.hpp"
#include "models/post/preference_loss.hpp"
#include "models/post/sequence_logprob.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;

namespace {

nlohmann::json fixture() {
  std::ifstream in(std::filesystem::path(TROUPE_SOURCE_DIR) /
                   "tests/fixtures/post/preference_losses.json");
  REQUIRE(in.good());
  return nlohmann::json::parse(in);
}

std::vector<double> vec(const nlohmann::json& j) {
  return j.get<std::vector<double>>();
}

// Both sides are f64 evaluations of the same closed forms (sums of 6 terms of size <= ~10):
// they agree to a few ulps of 1e1, so 1e-12 absolute is far above rounding and far below any
// mistake in a formula (a wrong sign, a missing beta or 1/n changes the values at 1e-3 and more).
void check_close(const std::vector<double>& got, const std::vector<double>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) CHECK(got[i] == Approx(want[i]).margin(1e-12));
}

}  // namespace

TEST_CASE("DPO sigmoid and IPO losses and gradients equal TRL's formulas in PyTorch", "[cpu]") {
  int seen = 0;
  for (const auto& c : fixture()) {
    if (c["kind"] != "dpo") continue;
    ++seen;
    INFO(c["loss_type"].get<std::string>() << " beta " << c["beta"].get<double>());
    const dpo_options opt{.type = parse_dpo_loss_type(c["loss_type"].get<std::string>()).value(),
                          .beta = c["beta"],
                          .label_smoothing = c["label_smoothing"]};
    const auto pc = vec(c["policy_chosen"]), pr = vec(c["policy_rejected"]);
    const auto rc = vec(c["reference_chosen"]), rr = vec(c["reference_rejected"]);
    const dpo_result r = dpo_loss(pc, pr, rc, rr, opt);
    CHECK(r.loss == Approx(c["loss"].get<double>()).margin(1e-12));
    check_close(r.d_chosen, vec(c["d_policy_chosen"]));
    check_close(r.d_rejected, vec(c["d_policy_rejected"]));
    CHECK(r.rewards_chosen == Approx(c["rewards_chosen"].get<double>()).margin(1e-12));
    CHECK(r.rewards_rejected == Approx(c["rewards_rejected"].get<double>()).margin(1e-12));
    CHECK(r.accuracy == c["accuracy"].get<double>());
    CHECK(r.margin == Approx(c["margin"].get<double>()).margin(1e-12));
  }
  CHECK(seen == 4);
}

TEST_CASE("the reward model's Bradley-Terry loss equals -logsigmoid(r_c - r_r) in PyTorch",
          "[cpu]") {
  int seen = 0;
  for (const auto& c : fixture()) {
    if (c["kind"] != "reward") continue;
    ++seen;
    const reward_result r = bradley_terry_loss(vec(c["chosen"]), vec(c["rejected"]));
    CHECK(r.loss == Approx(c["loss"].get<double>()).margin(1e-12));
    check_close(r.d_chosen, vec(c["d_chosen"]));
    check_close(r.d_rejected, vec(c["d_rejected"]));
    CHECK(r.accuracy == c["accuracy"].get<double>());
  }
  CHECK(seen == 1);
}

TEST_CASE("bad DPO options are refused naming the option", "[cpu][faults]") {
  const std::vector<double> one{1.0};
  CHECK_THROWS_WITH(dpo_loss(one, one, one, one, {.beta = 0}), Catch::Contains("beta"));
  CHECK_THROWS_WITH(dpo_loss(one, one, one, one, {.label_smoothing = 0.5}),
                    Catch::Contains("label_smoothing"));
  auto t = parse_dpo_loss_type("kto");
  REQUIRE_FALSE(t.has_value());
  CHECK_THAT(t.error_message(), Catch::Contains("sigmoid or ipo"));
  std::printf("faults: DPO loss kto -> refused: %s\n", t.error_message().c_str());
}

TEST_CASE("sequence log-probabilities sum the response tokens and backpropagate", "[cpu]") {
  const std::int64_t b = 3, t = 5, v = 7, n = b * t;
  rng g(11);
  owned_tensor logits = random_tensor({n, v}, g, 3.0);
  owned_tensor targets = empty({n}, dtype::i32);
  for (std::int64_t i = 0; i < n; ++i)  // about a third ignored: the prompt and padding
    targets.data_as<std::int32_t>()[i] =
        g.integer(0, 2) == 0 ? -100 : static_cast<std::int32_t>(g.integer(0, v - 1));
  owned_tensor losses = host_zeros({n});
  for (bool average : {false, true}) {
    INFO("average " << average);
    const sequence_logprob_options opt{.average = average};
    // Plain loops: log softmax per row.
    auto reference = [&](const tensor& lg) {
      std::vector<double> out(b, 0.0);
      for (std::int64_t s = 0; s < b; ++s) {
        int count = 0;
        for (std::int64_t r = s * t; r < (s + 1) * t; ++r) {
          const int y = targets.data_as<std::int32_t>()[r];
          if (y == -100) continue;
          const double* row = ptr(lg) + r * v;
          double m = *std::max_element(row, row + v), z = 0;
          for (std::int64_t k = 0; k < v; ++k) z += std::exp(row[k] - m);
          out[s] += row[y] - m - std::log(z);
          ++count;
        }
        if (average && count > 0) out[s] /= count;
      }
      return out;
    };
    const auto got = sequence_logprobs(logits, targets, t, losses, opt);
    const auto want = reference(logits);
    for (std::int64_t s = 0; s < b; ++s) CHECK(got[s] == Approx(want[s]).margin(1e-12));

    // Gradient of f = sum_s w_s logp_s against central differences of the plain loops (f64, step
    // 1e-6: truncation ~1e-12 * |f'''|, cancellation ~1e-16 / 1e-6; 1e-7 separates them from a
    // wrong scale or sign, which is O(1)).
    const std::vector<double> w{0.7, -1.3, 2.1};
    owned_tensor dlogits = host_zeros({n, v});
    sequence_logprobs_backward(logits, targets, t, w, losses, dlogits, opt);
    for (std::int64_t i = 0; i < n * v; i += 3) {
      double* p = ptr(logits) + i;
      const double keep = *p, h = 1e-6;
      *p = keep + h;
      const auto up = reference(logits);
      *p = keep - h;
      const auto down = reference(logits);
      *p = keep;
      double fd = 0;
      for (std::int64_t s = 0; s < b; ++s) fd += w[s] * (up[s] - down[s]) / (2 * h);
      CHECK(ptr(dlogits)[i] == Approx(fd).margin(1e-7));
    }
  }
}
