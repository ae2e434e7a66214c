// Training state beside the weights: the AdamW moments and step counts round trip exactly, and a
// state that does not fit the model, or a pair of files torn by a crash, is rejected.
#include <catch2/catch.hpp>

#include <cstring>

#include "models/gpt.hpp"
#include "models/hf/safetensors.hpp"
#include "models/hf/testing.hpp"
#include "models/hf/training_state.hpp"
#include "models/optim.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::hf;
using namespace troupe::models::hf::testing;
using Catch::Contains;

namespace {

std::string bytes_of(const tensor& t) {
  return std::string(static_cast<const char*>(t.data()), t.nbytes());
}

// An optimizer after a few steps on the tiny GPT, so that m and v hold real, distinct values.
struct trained {
  gpt model{{.vocab = 12, .max_seq = 8, .dim = 16, .n_layer = 1, .n_head = 2}, {2, 8}};
  adamw_optimizer opt{model.memory().params(), {.weight_decay = 0.1}};
  trained() {
    model.init_weights(4);
    std::vector<std::int32_t> ids(16), tg(16);
    for (int i = 0; i < 16; ++i) ids[i] = (i * 5) % 12, tg[i] = (i * 7 + 2) % 12;
    tensor x(ids.data(), 64, dtype::i32, {2, 8}), y(tg.data(), 64, dtype::i32, {2, 8});
    for (int s = 0; s < 3; ++s) {
      model.memory().zero_grads();
      model.forward(x, y);
      model.backward();
      opt.step(model.memory().params(), model.memory().grads(), 1e-2);
    }
  }
};

}  // namespace

TEST_CASE("Optimizer moments and step counts round trip exactly", "[cpu]") {
  temp_dir dir;
  trained t;
  const training_state state{.step = 3,
                             .optimizer_steps = 2,
                             .extra_json = R"({"seed": 7, "data": {"epoch": 1, "pos": 96}})"};
  auto files = save_training_state(dir.path(), state, t.opt.m(), t.opt.v());
  REQUIRE(files.has_value());
  CHECK(list_files(dir.path()) ==
        std::vector<std::string>{"optimizer.safetensors", "trainer_state.json"});
  CHECK_THAT(read_bytes(dir / "trainer_state.json"),
             Contains("\"format_version\": 1") && Contains("\"step\": 3"));

  owned_tensor m = zeros(t.opt.m().sizes()), v = zeros(t.opt.v().sizes());
  auto back = load_training_state(dir.path(), m, v);
  REQUIRE(back.has_value());
  CHECK(back->step == 3);
  CHECK(back->optimizer_steps == 2);
  CHECK_THAT(back->extra_json, Contains("\"pos\":96") && Contains("\"seed\":7"));
  CHECK(bytes_of(m) == bytes_of(t.opt.m()));
  CHECK(bytes_of(v) == bytes_of(t.opt.v()));
  CHECK(ops::sum_squares(m) > 0);

  // f64 moments keep their dtype on disk.
  owned_tensor m64 = empty({5}, dtype::f64), v64 = empty({5}, dtype::f64);
  for (int i = 0; i < 5; ++i) m64.data_as<double>()[i] = 1.0 / 3 + i, v64.data_as<double>()[i] = i;
  REQUIRE(save_training_state(dir.path(), {.step = 1}, m64, v64).has_value());
  owned_tensor m2 = zeros({5}, dtype::f64), v2 = zeros({5}, dtype::f64);
  REQUIRE(load_training_state(dir.path(), m2, v2).has_value());
  CHECK(bytes_of(m2) == bytes_of(m64));
  CHECK(bytes_of(v2) == bytes_of(v64));
}

TEST_CASE("Training state that does not fit the model is rejected naming the file", "[cpu]") {
  temp_dir dir;
  trained t;
  REQUIRE(save_training_state(dir.path(), {.step = 5, .optimizer_steps = 5}, t.opt.m(), t.opt.v())
              .has_value());
  const fs::path state = dir / "trainer_state.json", opt = dir / "optimizer.safetensors";
  owned_tensor m = zeros(t.opt.m().sizes()), v = zeros(t.opt.v().sizes());
  auto error = [&](const tensor& mm, const tensor& vv) {
    auto r = load_training_state(dir.path(), mm, vv);
    REQUIRE_FALSE(r.has_value());
    return r.error_message();
  };

  SECTION("moments of another model") {
    owned_tensor small = zeros({10});
    CHECK_THAT(error(small, small), Contains(opt.string()) && Contains("tensor 'm'") &&
                                        Contains("the model's optimizer state is [10]"));
  }
  SECTION("a pair of files from different saves") {
    write_bytes(state, replace_first(read_bytes(state), "\"step\": 5", "\"step\": 6"));
    CHECK_THAT(error(m, v),
               Contains(opt.string()) && Contains("is from step 5") && Contains("is from step 6"));
  }
  SECTION("a missing or malformed trainer_state.json") {
    const std::string good = read_bytes(state);
    fs::remove(state);
    CHECK_THAT(error(m, v), Contains(state.string()) && Contains("cannot open"));
    write_bytes(state, "{\"step\": ");
    CHECK_THAT(error(m, v), Contains(state.string()) && Contains("not valid JSON"));
    write_bytes(state, replace_first(good, "\"format_version\": 1", "\"format_version\": 9"));
    CHECK_THAT(error(m, v), Contains(state.string()) && Contains("format_version 9"));
    write_bytes(state, replace_first(good, "\"step\": 5", "\"step\": -5"));
    CHECK_THAT(error(m, v), Contains("field 'step' must be a non-negative integer"));
  }
  SECTION("shapes in trainer_state.json that disagree with optimizer.safetensors") {
    write_bytes(state, replace_first(read_bytes(state), std::to_string(m.numel()), "3"));
    CHECK_THAT(error(m, v), Contains(state.string()) && Contains("field 'm'"));
  }
  SECTION("an optimizer file without v") {
    REQUIRE(save_safetensors(opt, {{"m", t.opt.m()}}, {{"step", "5"}}).has_value());
    CHECK_THAT(error(m, v), Contains(opt.string()) && Contains("no tensor 'v'"));
  }
  SECTION("extra state that is not a JSON object") {
    auto r = save_training_state(dir.path(), {.extra_json = "[1]"}, m, v);
    REQUIRE_FALSE(r.has_value());
    CHECK_THAT(r.error_message(), Contains("extra_json must be a JSON object"));
  }
}

TEST_CASE("A training state save that fails keeps the previous one", "[cpu]") {
  temp_dir dir;
  trained t;
  REQUIRE(save_training_state(dir.path(), {.step = 3}, t.opt.m(), t.opt.v()).has_value());
  const std::string opt_before = read_bytes(dir / "optimizer.safetensors");
  const std::string state_before = read_bytes(dir / "trainer_state.json");
  owned_tensor m = zeros(t.opt.m().sizes()), v = zeros(t.opt.v().sizes());
  ops::fill(m, 1.0);
  expected<std::vector<fs::path>> r = std::vector<fs::path>{};
  {
    file_size_limit limit(1024);
    r = save_training_state(dir.path(), {.step = 4}, m, v);
  }
  REQUIRE_FALSE(r.has_value());
  CHECK(read_bytes(dir / "optimizer.safetensors") == opt_before);
  CHECK(read_bytes(dir / "trainer_state.json") == state_before);
  CHECK(list_files(dir.path()) ==
        std::vector<std::string>{"optimizer.safetensors", "trainer_state.json"});
}
