// The single-process trainer's checkpoint records how its run read its data (the seed, the data,
// batch, grad_accum, seq, fixed_batch) and its learning-rate schedule under the keys a parallel
// plan's checkpoint uses, and a resume whose run would read other batches is refused naming the
// setting's flag, before anything is loaded; other settings (the step count, the learning rate)
// may change across a resume.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "models/hf/config.hpp"
#include "models/offload/offload_trainer.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;
namespace fs = std::filesystem;

namespace {

void rows_of(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 31 + i * 5) % 29);
}

// A folder of this process removed at the end of the test case.
struct temp_folder {
  explicit temp_folder(const std::string& what)
      : path(fs::temp_directory_path() /
             ("troupe_trainer_resume_" + what + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~temp_folder() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

// The run: a text file of the test's own as its recorded data, 2 steps saved into `ckpt`.
train_config saved_run(const fs::path& text) {
  train_config c;
  c.data_text = text.string();
  c.steps = 4;
  c.batch = 2;
  c.seq = 8;
  c.grad_accum = 1;
  c.seed = 7;
  c.warmup = 2;
  return c;
}

// trainer_state.json's "extra" of a checkpoint folder.
nlohmann::json saved_extra(const fs::path& ckpt) {
  std::ifstream f(ckpt / "trainer_state.json");
  return nlohmann::json::parse(f)["extra"];
}

// saved_run(text) trained 2 steps by the plain trainer and saved into ckpt.
void save_two_steps(const fs::path& text, const fs::path& ckpt, const hf::model_config& mcfg) {
  auto model = make_causal_lm(mcfg, {2, 8});
  model->init_weights(3);
  trainer t(*model, saved_run(text));
  for (int s = 0; s < 2; ++s) t.step(rows_of);
  REQUIRE(t.save(ckpt, mcfg).has_value());
}

}  // namespace

TEST_CASE("A single-process checkpoint records how its run read its data", "[cpu]") {
  temp_folder dir("fields");
  const fs::path text = dir.path / "corpus.txt", ckpt = dir.path / "ckpt";
  std::ofstream(text) << "some text";
  const auto mcfg = named_model_config("gpt2-demo", 29).value();
  auto model = make_causal_lm(mcfg, {2, 8});
  model->init_weights(3);
  train_config cfg = saved_run(text);
  cfg.grad_accum = 2;
  trainer t(*model, cfg);
  t.step(rows_of);
  REQUIRE(t.save(ckpt, mcfg).has_value());

  auto extra = saved_extra(ckpt);
  CHECK(extra["seed"] == 7);
  CHECK(extra["data"] == "data.text " + fs::canonical(text).string());
  CHECK(extra["batch"] == 2);
  CHECK(extra["grad_accum"] == 2);
  CHECK(extra["seq"] == 8);
  CHECK(extra["fixed_batch"] == false);
  CHECK(extra["steps"] == 4);
  CHECK(extra["warmup"] == 2);
  CHECK(extra["lr"] == cfg.lr);
  CHECK(extra["min_lr"] == cfg.min_lr);
  CHECK(extra["precision"] == "f32");
  CHECK(extra["loss_scale"] == 1.0);  // the trainer's own keys, for f16 runs
  CHECK(extra["good_steps"] == 0);
}

TEST_CASE("A single-process resume whose run would read other batches is refused naming the flag",
          "[cpu]") {
  temp_folder dir("refused");
  const fs::path text = dir.path / "corpus.txt", other = dir.path / "other.txt",
                 ckpt = dir.path / "ckpt";
  std::ofstream(text) << "some text";
  std::ofstream(other) << "other text";
  const auto mcfg = named_model_config("gpt2-demo", 29).value();
  save_two_steps(text, ckpt, mcfg);
  struct change {
    std::function<void(train_config&)> apply;
    std::string setting, saved, now;  // the values as JSON
  };
  auto quoted = [](const fs::path& f) { return "\"data.text " + fs::canonical(f).string() + "\""; };
  const std::vector<change> changes = {
      {[](train_config& c) { c.batch = 1; }, "train.batch (--batch)", "2", "1"},
      {[](train_config& c) { c.seq = 4; }, "train.seq (--seq)", "8", "4"},
      {[](train_config& c) { c.grad_accum = 2; }, "train.grad_accum (--grad-accum)", "1", "2"},
      {[](train_config& c) { c.seed = 8; }, "train.seed (--seed)", "7", "8"},
      {[](train_config& c) { c.fixed_batch = true; }, "train.fixed_batch (--fixed-batch)", "false",
       "true"},
      {[&](train_config& c) { c.data_text = other.string(); }, "--tokens / --text)", quoted(text),
       quoted(other)},
  };
  for (const auto& ch : changes) {
    INFO(ch.setting);
    train_config cfg = saved_run(text);
    ch.apply(cfg);
    auto model = make_causal_lm(mcfg, {2, 8});
    model->init_weights(99);
    const tensor& p = model->memory().params();
    const std::vector<float> before(p.data_as<float>(), p.data_as<float>() + p.numel());
    trainer t(*model, cfg);
    auto r = t.resume(ckpt, mcfg);
    REQUIRE(!r.has_value());
    const std::string& msg = r.error_message();
    CHECK_THAT(msg, Catch::Contains((ckpt / "trainer_state.json").string()) &&
                        Catch::Contains(ch.setting + " = " + ch.saved) &&
                        Catch::Contains("this run has " + ch.now));
    CHECK(std::memcmp(p.data(), before.data(), before.size() * sizeof(float)) == 0);
    CHECK(t.steps_done() == 0);
  }
  // The step count and the learning rate are no data position: such a resume goes on.
  train_config longer = saved_run(text);
  longer.steps = 6;
  longer.lr = 1e-3;
  auto model = make_causal_lm(mcfg, {2, 8});
  trainer t(*model, longer);
  auto r = t.resume(ckpt, mcfg);
  REQUIRE(r.has_value());
  CHECK(*r == 2);
}

TEST_CASE("A run with memory tiers records the data position and refuses a resume at another seq",
          "[cpu]") {
  temp_folder dir("offload");
  const fs::path text = dir.path / "corpus.txt", ckpt = dir.path / "ckpt",
                 own = dir.path / "offloaded";
  std::ofstream(text) << "some text";
  const auto mcfg = named_model_config("gpt2-demo", 29).value();
  const gpt_config g = hf::to_gpt_config(std::get<hf::gpt2_config>(mcfg));
  save_two_steps(text, ckpt, mcfg);
  offload_options o;
  o.device_bytes = std::size_t{1} << 30;  // everything resident: the tiers are not the point
  causal_lm_of<gpt> staging(g, batch_dims{1, 8});

  train_config other = saved_run(text);
  other.seq = 4;
  offload_trainer refused(g, other, o);
  auto r = refused.resume(ckpt, mcfg, staging);
  REQUIRE(!r.has_value());
  CHECK_THAT(r.error_message(), Catch::Contains((ckpt / "trainer_state.json").string()) &&
                                    Catch::Contains("train.seq (--seq) = 8") &&
                                    Catch::Contains("this run has 4"));

  offload_trainer same(g, saved_run(text), o);
  REQUIRE(same.resume(ckpt, mcfg, staging).value() == 2);
  same.step(rows_of);
  REQUIRE(same.save(own, mcfg, staging).has_value());
  auto extra = saved_extra(own);
  CHECK(extra["offload"] == true);
  CHECK(extra["seq"] == 8);
  CHECK(extra["batch"] == 2);
  CHECK(extra["seed"] == 7);
  CHECK(extra["data"] == "data.text " + fs::canonical(text).string());
}

// The loss scale goes on only from an f16 run: an f32 checkpoint records 1, which would make an
// f16 run resumed from it scale its loss by 1 (small gradients flush to zero in f16).
TEST_CASE("An f16 resume of an f32 checkpoint starts from the initial loss scale", "[cpu]") {
  temp_folder dir("f16");
  const fs::path text = dir.path / "corpus.txt", ckpt = dir.path / "ckpt";
  std::ofstream(text) << "some text";
  const auto mcfg = named_model_config("gpt2-demo", 29).value();
  save_two_steps(text, ckpt, mcfg);
  auto model = make_causal_lm(mcfg, {2, 8}, dtype::f16);
  train_config cfg = saved_run(text);
  cfg.precision = "f16";
  trainer t(*model, cfg);
  auto step = t.resume(ckpt, mcfg);
  REQUIRE(step.has_value());
  CHECK(*step == 2);
  CHECK(t.step(rows_of).loss_scale == 65536.0);
}
