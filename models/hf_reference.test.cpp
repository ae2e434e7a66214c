// The models against Hugging Face: tiny random GPT2LMHeadModel and LlamaForCausalLM checkpoints
// with reference numbers from scripts/reference/make_model_fixtures.py (tests/fixtures/models/).
// For each: logits and loss (f32 and f64), the gradient of every parameter, and the losses of 10
// AdamW steps and the weights after them.
//
// Tolerances. Both sides compute in f32 with different summation orders (OpenBLAS vs MKL-less
// torch CPU GEMMs, flash-style vs materialized softmax), so each value carries ~1e-7 relative
// rounding per operation and ~1e-6 after the model's few dozen operations; we allow 2e-5 of the
// tensor's largest magnitude for logits and 1e-4 for gradients (cross-entropy gradients cancel:
// softmax - onehot). In f64 the same semantics leave only ~1e-15 rounding: 1e-10 proves the
// forward is the same function. AdamW normalises each update (m / sqrt(v)), so gradient noise
// of 1e-5 relative moves an update of lr = 1e-3 by ~1e-8: final weights within 1e-4 relative,
// except for the key biases, whose gradients (nearly) vanish (see gpt2_name and llama_name).
#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memory/gpu.hpp"
#include "models/gpt.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/config.hpp"
#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "models/optim.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::testing;
namespace fs = std::filesystem;

namespace {

fs::path fixture_dir(const std::string& name) {
  return fs::path(TROUPE_SOURCE_DIR) / "tests" / "fixtures" / "models" / name;
}

// A minimal safetensors reader for the fixtures (F32, F64, I64 only), as doubles.
struct st_tensor {
  std::vector<std::int64_t> shape;
  std::vector<double> data;
};
using st_file = std::map<std::string, st_tensor>;

st_file read_safetensors(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  REQUIRE(in.good());
  std::uint64_t n = 0;
  in.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  in.read(header.data(), static_cast<std::streamsize>(n));
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto j = nlohmann::json::parse(header);
  st_file out;
  for (auto& [name, v] : j.items()) {
    if (name == "__metadata__") continue;
    st_tensor t;
    t.shape = v["shape"].get<std::vector<std::int64_t>>();
    auto off = v["data_offsets"].get<std::vector<std::size_t>>();
    std::string dt = v["dtype"].get<std::string>();
    const char* p = bytes.data() + off[0];
    std::size_t len = off[1] - off[0];
    auto take = [&]<class T>(T) {
      t.data.resize(len / sizeof(T));
      for (std::size_t i = 0; i < t.data.size(); ++i) {
        T x;
        std::memcpy(&x, p + i * sizeof(T), sizeof(T));
        t.data[i] = static_cast<double>(x);
      }
    };
    if (dt == "F32")
      take(float{});
    else if (dt == "F64")
      take(double{});
    else if (dt == "I64")
      take(std::int64_t{});
    else
      FAIL("unexpected dtype " << dt << " of " << name);
    out[name] = std::move(t);
  }
  return out;
}

// HF's name of one of our parameters, whether its layout is transposed (GPT-2's Conv1D), the
// elements [zero_lo, zero_hi) whose true gradient is zero (in thirds of the tensor), and the
// tolerance of its weights after the 10 AdamW steps.
struct hf_name {
  std::string name;
  bool transposed = false;
  std::int64_t zero_lo = 0, zero_hi = 0;
  double final_tol = 1e-4;
};

// GPT-2's key bias (the middle third of c_attn.bias) adds q.b_k to every score of a query: a
// constant per softmax row, so the loss does not depend on it and its gradient is rounding noise.
hf_name gpt2_name(const std::string& ours) {
  static const std::pair<const char*, const char*> renames[] = {{"attn.qkv_proj.", "attn.c_attn."},
                                                                {"attn.o_proj.", "attn.c_proj."},
                                                                {"mlp.fc.", "mlp.c_fc."},
                                                                {"mlp.proj.", "mlp.c_proj."}};
  std::string n = ours;
  bool conv = false;
  for (auto [from, to] : renames) {
    auto at = n.find(from);
    if (at != std::string::npos) {
      n.replace(at, std::strlen(from), to);
      conv = n.ends_with(".weight");
    }
  }
  hf_name h{"transformer." + n, conv};
  if (ours.ends_with("attn.qkv_proj.bias")) {
    h.zero_lo = 1;  // in thirds, resolved by the caller with the tensor's size
    h.zero_hi = 2;
  }
  return h;
}

// Llama's key bias is nearly as degenerate as GPT-2's: RoPE rotates it with the key position, but
// the slow frequencies barely turn over 8 positions (at theta 5e5 the slowest pair moves 1e-3
// rad), so in those dimensions it is almost a constant per softmax row; its gradient nearly
// cancels and Adam amplifies the rounding. Torch's own float32 run differs from its float64 run
// by 2e-4 of the tensor there, so it gets 1e-3.
hf_name llama_name(const std::string& ours) {
  hf_name h{ours == "lm_head.weight" ? ours : "model." + ours, false};
  if (ours.ends_with("self_attn.k_proj.bias")) h.final_tol = 1e-3;
  return h;
}

// A tensor of ours (on any device) as f64 in HF's layout.
std::vector<double> in_hf_layout(const tensor& t_any, bool transposed) {
  owned_tensor host;
  if (!t_any.is_cpu()) host = to_device(t_any, device::cpu());
  const tensor& t = t_any.is_cpu() ? t_any : host.view();
  std::vector<double> v(t.numel());
  auto get = [&](std::int64_t i) {
    return t.type() == dtype::f32 ? static_cast<double>(ptr<float>(t)[i]) : ptr(t)[i];
  };
  if (!transposed) {
    for (std::int64_t i = 0; i < t.numel(); ++i) v[i] = get(i);
  } else {
    std::int64_t rows = t.size(0), cols = t.size(1);  // ours [out, in] -> HF [in, out]
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c) v[c * rows + r] = get(r * cols + c);
  }
  return v;
}

void load_param(const tensor& field_any, const st_tensor& src, bool transposed) {
  REQUIRE(static_cast<std::int64_t>(src.data.size()) == field_any.numel());
  owned_tensor host;
  if (!field_any.is_cpu()) host = empty(field_any.sizes(), field_any.type());
  const tensor& field = field_any.is_cpu() ? field_any : host.view();
  std::int64_t rows = field.dim() == 2 ? field.size(0) : 1, cols = field.numel() / rows;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      double x = transposed ? src.data[c * rows + r] : src.data[r * cols + c];
      if (field.type() == dtype::f32)
        ptr<float>(field)[r * cols + c] = static_cast<float>(x);
      else
        ptr(field)[r * cols + c] = x;
    }
  if (!field_any.is_cpu()) ops::copy(to_device(host, field_any.dev()), field_any);
}

// max |a - b| / max |b|: the error relative to the tensor's scale.
double scaled_diff(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(a[i] - b[i]));
    den = std::max(den, std::abs(b[i]));
  }
  return den == 0 ? num : num / den;
}

std::vector<double> logits_of(const tensor& t) {
  return in_hf_layout(t, false);
}

struct fixture {
  nlohmann::json config;
  st_file weights, ref;
  std::vector<std::int32_t> ids, targets;
  std::int64_t b = 0, t = 0;
};

fixture load_fixture(const std::string& name) {
  fs::path dir = fixture_dir(name);
  INFO("fixture folder " << dir.string());
  REQUIRE(fs::exists(dir / "config.json"));
  fixture f;
  std::ifstream cfg(dir / "config.json");
  f.config = nlohmann::json::parse(cfg);
  f.weights = read_safetensors(dir / "model.safetensors");
  f.ref = read_safetensors(dir / "reference.safetensors");
  const st_tensor& ids = f.ref.at("input_ids");
  f.b = ids.shape[0];
  f.t = ids.shape[1];
  for (double v : ids.data) f.ids.push_back(static_cast<std::int32_t>(v));
  f.targets.resize(f.ids.size());
  tensor ti(f.ids.data(), f.ids.size() * 4, dtype::i32, {f.b, f.t});
  tensor tt(f.targets.data(), f.targets.size() * 4, dtype::i32, {f.b, f.t});
  next_token_targets(ti, tt);
  return f;
}

gpt_config gpt2_config(const nlohmann::json& c) {
  return {.vocab = c["vocab_size"],
          .max_seq = c["n_positions"],
          .dim = c["n_embd"],
          .n_layer = c["n_layer"],
          .n_head = c["n_head"],
          .ln_eps = c["layer_norm_epsilon"],
          .hidden = c["n_inner"].is_null() ? 0 : c["n_inner"].get<std::int64_t>()};
}

llama_config llama_config_of(const nlohmann::json& c) {
  return {.vocab = c["vocab_size"],
          .dim = c["hidden_size"],
          .n_layer = c["num_hidden_layers"],
          .n_head = c["num_attention_heads"],
          .n_kv_head = c["num_key_value_heads"],
          .hidden = c["intermediate_size"],
          .rms_eps = c["rms_norm_eps"],
          .rope_theta = c["rope_theta"],
          .max_seq = c["max_position_embeddings"],
          .tie_embeddings = c["tie_word_embeddings"],
          .attention_bias = c["attention_bias"]};
}

// Loads the checkpoint into the model; every tensor of the file is used exactly once.
template <class Model>
void load_weights(Model& model, const fixture& f, hf_name (*map)(const std::string&)) {
  std::size_t used = 0;
  for (const auto& s : model.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    hf_name h = map(s.name);
    INFO("parameter " << s.name << " from " << h.name);
    REQUIRE(f.weights.count(h.name) == 1);
    load_param(*s.field, f.weights.at(h.name), h.transposed);
    ++used;
  }
  CHECK(used == f.weights.size());  // no tensor of the file left unused
}

// Forward (f32, and f64 on the CPU), backward and 10 AdamW steps against the fixture.
template <class Model, class Config>
void check_model(const fixture& f, const Config& cfg, hf_name (*map)(const std::string&),
                 device dev = device::cpu()) {
  tensor ids_host(const_cast<std::int32_t*>(f.ids.data()), f.ids.size() * 4, dtype::i32,
                  {f.b, f.t});
  tensor targets_host(const_cast<std::int32_t*>(f.targets.data()), f.targets.size() * 4, dtype::i32,
                      {f.b, f.t});
  owned_tensor ids_dev, targets_dev;
  if (!dev.is_cpu()) {
    ids_dev = to_device(ids_host, dev);
    targets_dev = to_device(targets_host, dev);
  }
  const tensor& ids = dev.is_cpu() ? ids_host : ids_dev.view();
  const tensor& targets = dev.is_cpu() ? targets_host : targets_dev.view();
  if (dev.is_cpu()) {
    INFO("f64 forward");
    Model m64(cfg, {f.b, f.t}, dtype::f64);
    load_weights(m64, f, map);
    double loss = m64.forward(ids, targets);
    CHECK(loss == Approx(f.ref.at("loss_f64").data[0]).epsilon(1e-12));
    CHECK(scaled_diff(logits_of(m64.logits()), f.ref.at("logits_f64").data) <= 1e-10);
  }
  Model model(cfg, {f.b, f.t}, dtype::f32, dev);
  load_weights(model, f, map);
  model.memory().zero_grads();
  double loss = model.forward(ids, targets);
  CHECK(loss == Approx(f.ref.at("loss").data[0]).epsilon(1e-5));
  CHECK(scaled_diff(logits_of(model.logits()), f.ref.at("logits").data) <= 2e-5);
  model.backward();
  for (const auto& s : model.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    hf_name h = map(s.name);
    INFO("gradient of " << s.name << " (" << h.name << ")");
    CHECK(scaled_diff(in_hf_layout(*s.grad, h.transposed), f.ref.at("grad." + h.name).data) <=
          1e-4);
  }

  // 10 AdamW steps on the same batch (no clipping): the loss before each, the weights after.
  Model trained(cfg, {f.b, f.t}, dtype::f32, dev);
  load_weights(trained, f, map);
  adamw_optimizer opt(trained.memory().params(),
                      {.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1});
  const std::vector<double>& losses = f.ref.at("losses").data;
  for (std::size_t step = 0; step < losses.size(); ++step) {
    trained.memory().zero_grads();
    double l = trained.forward(ids, targets);
    INFO("step " << step);
    CHECK(l == Approx(losses[step]).epsilon(1e-5));
    trained.backward();
    opt.step(trained.memory().params(), trained.memory().grads(), 1e-3);
  }
  for (const auto& s : trained.slots().slots()) {
    if (s.kind != slot_kind::param) continue;
    hf_name h = map(s.name);
    INFO("weights after 10 steps: " << s.name << " (" << h.name << ")");
    std::vector<double> ours = in_hf_layout(*s.field, h.transposed);
    std::vector<double> ref = f.ref.at("final." + h.name).data;
    if (h.zero_hi > h.zero_lo) {
      // Adam turns the noise of a zero gradient into steps of up to ~lr with arbitrary signs on
      // each side, so these elements can only be held to 2 * lr per step. Their gradient must be
      // noise in HF's numbers too (relative to the tensor's largest gradient).
      std::int64_t third = s.field->numel() / 3;
      const std::vector<double>& g = f.ref.at("grad." + h.name).data;
      double gmax = 0, gzero = 0;
      for (std::size_t i = 0; i < g.size(); ++i) gmax = std::max(gmax, std::abs(g[i]));
      for (std::int64_t i = h.zero_lo * third; i < h.zero_hi * third; ++i) {
        gzero = std::max(gzero, std::abs(g[i]));
        CHECK(std::abs(ours[i] - ref[i]) <= 2 * 1e-3 * static_cast<double>(losses.size()));
        ours[i] = ref[i];
      }
      CHECK(gzero <= 1e-5 * gmax);
    }
    CHECK(scaled_diff(ours, ref) <= h.final_tol);
  }
}

}  // namespace

TEST_CASE("GPT-2 matches Hugging Face GPT2LMHeadModel in forward backward and AdamW", "[cpu]") {
  for (const char* name : {"gpt2", "gpt2_inner"}) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    gpt_config cfg = gpt2_config(f.config);
    CHECK(f.config["activation_function"] == "gelu_new");
    check_model<gpt>(f, cfg, gpt2_name);
  }
}

TEST_CASE("Llama matches Hugging Face LlamaForCausalLM in forward backward and AdamW", "[cpu]") {
  for (const char* name : {"llama", "llama_tied", "llama_theta_bias"}) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    llama_config cfg = llama_config_of(f.config);
    CHECK(f.config["hidden_act"] == "silu");
    CHECK(f.config["rope_scaling"].is_null());
    check_model<llama>(f, cfg, llama_name);
  }
}

// The fixtures through the checkpoint reader (models/hf/): its config parsing, name maps and
// Conv1D transposes give the same parameters as this file's plain reader and the names above.
TEST_CASE("HF fixture folders load through the checkpoint reader to the same parameters", "[cpu]") {
  for (const char* name : {"gpt2", "llama", "llama_tied", "llama_theta_bias"}) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    auto hf_cfg = hf::read_config(fixture_dir(name));
    INFO((hf_cfg ? std::string() : hf_cfg.error_message()));
    REQUIRE(hf_cfg);
    auto compare = [&](auto& via_reader, auto& via_plain) {
      auto files = hf::load_weights(fixture_dir(name), hf_cfg.value(), via_reader.slots());
      INFO((files ? std::string() : files.error_message()));
      REQUIRE(files);
      CHECK(values(via_reader.memory().params()) == values(via_plain.memory().params()));
    };
    if (f.config["model_type"] == "gpt2") {
      gpt_config cfg = gpt2_config(f.config);
      CHECK(hf::to_gpt_config(std::get<hf::gpt2_config>(hf_cfg.value())).ln_eps == cfg.ln_eps);
      gpt a(cfg, {f.b, f.t}, dtype::f64), b(cfg, {f.b, f.t}, dtype::f64);
      load_weights(b, f, gpt2_name);
      compare(a, b);
    } else {
      llama_config cfg = llama_config_of(f.config);
      llama a(cfg, {f.b, f.t}, dtype::f64), b(cfg, {f.b, f.t}, dtype::f64);
      load_weights(b, f, llama_name);
      compare(a, b);
    }
  }
}

TEST_CASE("Both models on a GPU match Hugging Face in forward backward and AdamW", "[gpu]") {
  if (!memory::gpu_available()) {
    WARN("troupe-skip: no GPU");
    return;
  }
  for (const char* name : {"gpt2", "llama", "llama_tied", "llama_theta_bias"}) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    if (f.config["model_type"] == "gpt2")
      check_model<gpt>(f, gpt2_config(f.config), gpt2_name, device::cuda());
    else
      check_model<llama>(f, llama_config_of(f.config), llama_name, device::cuda());
  }
}
