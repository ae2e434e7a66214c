// whole_model: pieces filled one whole parameter at a time (init_piece, load_piece) hold bit for
// bit what the single-process model's init_weights and hf::load_weights give, sliced by
// scatter_to_piece (itself checked against the pieces' own load_from in reshard.test.cpp); the
// unbound model's layout is the bound model's; and the checkpoint files written tensor by tensor
// and in parts (checkpoint_writer, training_state_writer) are byte for byte the whole writers'.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/training_state.hpp"
#include "models/llama.hpp"
#include "models/parallel/gpt_stage.hpp"
#include "models/parallel/llama_stage.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/whole_model.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
namespace fs = std::filesystem;

namespace {

hf::model_config gpt2_small_test() {
  hf::gpt2_config g;
  g.vocab_size = 64;
  g.n_positions = 16;
  g.n_embd = 32;
  g.n_layer = 2;
  g.n_head = 4;
  return g;
}

hf::model_config llama_test() {
  return named_model_config("llama-tiny", 64).value();
}

struct scratch_dir {
  scratch_dir()
      : path(fs::temp_directory_path() / ("troupe-whole-model-" + std::to_string(::getpid()))) {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~scratch_dir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  fs::path path;
};

std::string bytes_of(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Every piece (tp shards, pipeline stages and shards of stages) of `model` with its layout; for
// each, fill(layout, into) must give exactly what scatter_to_piece takes from `whole_params`.
template <class Fill>
void check_pieces(const hf::model_config& model, const tensor& whole_params, const Fill& fill) {
  const whole_model wm(model);
  const bool is_gpt = std::holds_alternative<hf::gpt2_config>(model);
  const batch_dims dims{1, 16};
  auto comms = collective::make_local_group(2);
  for (int r = 0; r < 2; ++r) {
    const tp_group g{comms[r].get(), false};
    struct piece {
      const slot_list* slots;
      tensor base;
      std::string what;
    };
    std::vector<std::unique_ptr<causal_lm>> lms;
    std::vector<std::unique_ptr<pipeline_stage>> stages;
    std::vector<piece> pieces;
    if (is_gpt) {
      const gpt_config gc = hf::to_gpt_config(std::get<hf::gpt2_config>(model));
      lms.push_back(std::make_unique<causal_lm_of<tp_gpt>>(gc, dims, g));
      for (int st = 0; st < 2; ++st)
        stages.push_back(std::make_unique<gpt_stage>(
            gc, dims, stage_options{.stage = st, .stages = 2, .virtual_stages = 1, .first = {}},
            g));
    } else {
      const llama_config lc = to_llama_config(std::get<hf::llama_config>(model));
      lms.push_back(std::make_unique<causal_lm_of<tp_llama>>(lc, dims, g));
      for (int st = 0; st < 2; ++st)
        stages.push_back(std::make_unique<llama_stage>(
            lc, dims, stage_options{.stage = st, .stages = 2, .virtual_stages = 1, .first = {}},
            g));
    }
    for (auto& m : lms) pieces.push_back({&m->slots(), m->memory().params(), "tensor shard"});
    for (std::size_t st = 0; st < stages.size(); ++st)
      pieces.push_back({&stages[st]->slots(), stages[st]->memory().params(),
                        "shard of stage " + std::to_string(st)});
    for (const auto& p : pieces) {
      INFO(p.what << " " << r << " of 2");
      const piece_layout pl{p.slots, p.base, r, 2, {}};
      owned_tensor got = zeros(p.base.sizes()), want = zeros(p.base.sizes());
      fill(wm, pl, got.view());
      scatter_to_piece(wm.layout(), whole_params, pl, want);
      // Not vacuous: a no-op fill and a no-op scatter would agree on zeros.
      const float* w = want.data_as<float>();
      CHECK(std::any_of(w, w + want.numel(), [](float x) { return x != 0.0f; }));
      CHECK(std::memcmp(got.data(), want.data(), got.nbytes()) == 0);
    }
  }
}

}  // namespace

TEST_CASE("An unbound model lays its parameters out as the bound model does", "[parallel]") {
  for (const auto& model : {gpt2_small_test(), llama_test()}) {
    auto bound = make_causal_lm(model, {2, 16});
    const whole_model wm(model);
    const auto& w = wm.layout();
    CHECK(w.numel == bound->memory().params().numel());
    std::size_t k = 0;
    for (const auto& s : bound->slots().slots()) {
      if (s.kind != slot_kind::param) continue;
      REQUIRE(k < w.params.size());
      INFO(s.name);
      CHECK(w.params[k].name == s.name);
      CHECK(w.params[k].sizes == s.sizes);
      CHECK(w.params[k].offset == offset_in(*s.field, bound->memory().params()));
      ++k;
    }
    CHECK(k == w.params.size());
  }
}

TEST_CASE("Pieces initialised one parameter at a time hold the single-process init bit for bit",
          "[parallel]") {
  for (const auto& model : {gpt2_small_test(), llama_test()}) {
    auto whole = make_causal_lm(model, {1, 16});
    whole->init_weights(11);
    check_pieces(model, whole->memory().params(),
                 [](const whole_model& wm, const piece_layout& pl, const tensor& to) {
                   init_piece(wm, 11, pl, to);
                 });
  }
}

TEST_CASE("Pieces loaded from a checkpoint's files hold what the whole model loads", "[parallel]") {
  scratch_dir dir;
  for (const auto& model : {gpt2_small_test(), llama_test()}) {
    for (std::uint64_t shard_bytes : {std::uint64_t{0}, std::uint64_t{20000}}) {
      INFO("max_shard_bytes " << shard_bytes);
      auto saved = make_causal_lm(model, {1, 16});
      saved->init_weights(5);
      const fs::path ck = dir.path / ("ck" + std::to_string(shard_bytes));
      hf::save_checkpoint(ck, model, saved->slots(), {.max_shard_bytes = shard_bytes}).value();
      auto whole = make_causal_lm(model, {1, 16});
      hf::load_weights(ck, model, whole->slots()).value();
      check_pieces(model, whole->memory().params(),
                   [&](const whole_model& wm, const piece_layout& pl, const tensor& to) {
                     load_piece(wm, ck, pl, to);
                   });
    }
  }
}

TEST_CASE("A folder of weights that lacks a tensor fails loading a piece naming it", "[parallel]") {
  scratch_dir dir;
  const auto model = gpt2_small_test();
  auto other = gpt2_small_test();
  std::get<hf::gpt2_config>(other).n_layer = 1;  // h.1.* are missing
  auto saved = make_causal_lm(other, {1, 16});
  saved->init_weights(5);
  hf::save_checkpoint(dir.path, other, saved->slots()).value();
  const whole_model wm(model);
  const gpt_config gc = hf::to_gpt_config(std::get<hf::gpt2_config>(model));
  gpt piece(gc, {1, 16});
  const piece_layout pl{&piece.slots(), piece.memory().params(), 0, 1, {}};
  CHECK_THROWS_WITH(load_piece(wm, dir.path, pl, pl.base),
                    Catch::Contains("missing") && Catch::Contains("h.1."));
}

TEST_CASE("A piece that does not fit the folder's tensors fails loading naming folder and tensor",
          "[parallel]") {
  scratch_dir dir;
  const auto model = gpt2_small_test();
  auto saved = make_causal_lm(model, {1, 16});
  saved->init_weights(5);
  hf::save_checkpoint(dir.path, model, saved->slots()).value();
  const whole_model wm(model);
  auto wider = std::get<hf::gpt2_config>(model);
  wider.n_embd = 48;  // the same names, other shapes: slicing the first tensor read fails
  const gpt_config gc = hf::to_gpt_config(wider);
  gpt piece(gc, {1, 16});
  const piece_layout pl{&piece.slots(), piece.memory().params(), 0, 1, {}};
  CHECK_THROWS_WITH(load_piece(wm, dir.path, pl, pl.base),
                    Catch::StartsWith("load_piece: '" + dir.path.string() + "', tensor '"));
}

TEST_CASE("Checkpoint files written tensor by tensor and in parts equal the whole writers' bytes",
          "[parallel]") {
  scratch_dir dir;
  for (const auto& model : {gpt2_small_test(), llama_test()}) {
    auto whole = make_causal_lm(model, {1, 16});
    whole->init_weights(3);
    const fs::path a = dir.path / "a", b = dir.path / "b";
    fs::remove_all(a);
    fs::remove_all(b);
    fs::create_directories(b);
    hf::save_checkpoint(a, model, whole->slots()).value();
    hf::checkpoint_writer w(b, model);
    for (const auto& e : hf::checkpoint_writer::order(model))
      for (const auto& s : whole->slots().slots())
        if (s.kind == slot_kind::param && s.name == e.our_name) w.write(*s.field);
    w.commit();
    for (const char* f : {"model.safetensors", "config.json"}) {
      INFO(f);
      CHECK(bytes_of(a / f) == bytes_of(b / f));
    }

    const std::int64_t n = whole->memory().params().numel();
    owned_tensor m = zeros({n}), v = zeros({n});
    for (std::int64_t i = 0; i < n; ++i) {
      m.data_as<float>()[i] = static_cast<float>(i % 97) - 48.0f;
      v.data_as<float>()[i] = static_cast<float>(i % 89) * 0.5f;
    }
    const hf::training_state st{.step = 7, .optimizer_steps = 6, .extra_json = "{\"seed\": 1}"};
    hf::save_training_state(a, st, m, v).value();
    hf::training_state_writer tw(b, st, dtype::f32, shape{n});
    const std::int64_t cut = n / 3;
    tw.append(m.narrow(0, 0, cut));
    tw.append(m.narrow(0, cut, n - cut));
    tw.append(v.narrow(0, 0, n - 5));
    tw.append(v.narrow(0, n - 5, 5));
    tw.commit();
    for (const char* f : {"optimizer.safetensors", "trainer_state.json"}) {
      INFO(f);
      CHECK(bytes_of(a / f) == bytes_of(b / f));
    }
  }
}
