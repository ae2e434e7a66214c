// The models against Hugging Face: tiny random GPT2LMHeadModel, LlamaForCausalLM,
// MixtralForCausalLM and Qwen2MoeForCausalLM checkpoints with reference numbers from
// scripts/reference/make_model_fixtures.py (tests/fixtures/models/). For each: logits and loss (f32
// and f64), the gradient of every parameter, and the losses of 10 AdamW steps and the weights after
// them.
//
// Tolerances (tests/rounding.hpp). Our f32 run and torch's differ by rounding only (OpenBLAS vs
// torch's GEMMs, flash-style vs materialized softmax), by an amount that depends on the CPU's
// kernels; so each f32 value is judged by its distance to an exact (f64) evaluation, against the
// distance of torch's own f32 value: ours must be as accurate as torch's, up to default_k. The
// exact value is torch's float64 run for the logits and the loss, and our own f64 twin (the same
// weights, widened exactly) for the gradients and the AdamW run, whose float64 numbers the
// fixtures do not hold; that twin is the same function as torch's because its forward matches
// torch's float64 forward to f64 rounding, and the comparison is made both ways, so a backward
// or an optimizer wrong in both our precisions fails (torch's f32 would be far from it).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "memory/gpu.hpp"
#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/config.hpp"
#include "models/layers/testing.hpp"
#include "models/llama.hpp"
#include "models/moe.hpp"
#include "models/optim.hpp"
#include "models/targets.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

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
  return h;
}

// Mixtral's names: our mlp.* is its block_sparse_moe.*, our experts' gate_proj / up_proj /
// down_proj its w1 / w3 / w2.
hf_name mixtral_name(const std::string& ours) {
  if (ours == "lm_head.weight") return {ours};
  std::string n = ours;
  static const std::pair<const char*, const char*> renames[] = {{".mlp.", ".block_sparse_moe."},
                                                                {".gate_proj.", ".w1."},
                                                                {".up_proj.", ".w3."},
                                                                {".down_proj.", ".w2."}};
  for (auto [from, to] : renames)
    if (auto at = n.find(from); at != std::string::npos) n.replace(at, std::strlen(from), to);
  return {"model." + n};
}

// Qwen2-MoE's names are ours.
hf_name qwen2_moe_name(const std::string& ours) {
  return llama_name(ours);
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

// rope_scaling as transformers reads it ("rope_type", or "type" before 4.43). Dynamic scaling
// grows theta past max_position_embeddings, and the model is planned for factor times it (the
// rule of hf::to_llama_config, which the checkpoint-reader test below compares with this).
rope_scaling rope_scaling_of(const nlohmann::json& c) {
  rope_scaling r;
  const nlohmann::json& s = c["rope_scaling"];
  if (s.is_null()) return r;
  const std::string type = s.contains("rope_type") ? s["rope_type"] : s["type"];
  r.factor = s["factor"];
  if (type == "linear") {
    r.type = rope_scaling::kind::linear;
  } else if (type == "dynamic") {
    r.type = rope_scaling::kind::dynamic;
    r.original_max_position = c["max_position_embeddings"];
  } else {
    REQUIRE(type == "llama3");
    r.type = rope_scaling::kind::llama3;
    r.low_freq_factor = s["low_freq_factor"];
    r.high_freq_factor = s["high_freq_factor"];
    r.original_max_position = s["original_max_position_embeddings"];
  }
  return r;
}

llama_config llama_config_of(const nlohmann::json& c) {
  llama_config m{.vocab = c["vocab_size"],
                 .dim = c["hidden_size"],
                 .n_layer = c["num_hidden_layers"],
                 .n_head = c["num_attention_heads"],
                 .n_kv_head = c["num_key_value_heads"],
                 .hidden = c["intermediate_size"],
                 .rms_eps = c["rms_norm_eps"],
                 .rope_theta = c["rope_theta"],
                 .max_seq = c["max_position_embeddings"],
                 .tie_embeddings = c["tie_word_embeddings"],
                 .attention_bias = c["attention_bias"],
                 .mlp_bias = c.value("mlp_bias", false),
                 .rope_scale = rope_scaling_of(c)};
  if (m.rope_scale.type == rope_scaling::kind::dynamic)
    m.max_seq = std::max(
        m.max_seq, static_cast<std::int64_t>(m.rope_scale.factor * static_cast<double>(m.max_seq)));
  return m;
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

// Both f32 runs, ours and torch's, are as accurate as each other against `exact` (see the top
// of the file): ours within default_k of torch's error and torch's within default_k of ours.
struct two_way {
  tests::rounding_verdict ours, theirs;
  bool ok() const { return ours.ok() && theirs.ok(); }
  std::string str() const { return "ours: " + ours.str() + "; torch's: " + theirs.str(); }
};

two_way equally_accurate(const std::vector<double>& ours, const std::vector<double>& theirs,
                         const std::vector<double>& exact) {
  return {tests::as_accurate_as(ours, theirs, exact), tests::as_accurate_as(theirs, ours, exact)};
}

// The mean cross-entropy over n positions as a function of the logits: the derivative in one
// position's logits (softmax - onehot, over n) sums to at most 2 / n in absolute value, so logits
// off by at most e move the loss by at most 2 e; its own sums (the vocab exponentials of each
// position, then the n positions) add at most (vocab + n) u max(1, |loss|), once on each side.
double loss_bound(double logit_err, double loss, std::int64_t vocab, std::int64_t n, double u) {
  return 2 * logit_err + 2 * static_cast<double>(vocab + n) * u * std::max(1.0, std::abs(loss));
}

// f64's unit roundoff over f32's: an f64 evaluation rounds the same values as an f32 one, each
// rounding 2^-29 times smaller, so its error is the f32 error scaled by this.
constexpr double f64_over_f32 = 1.0 / static_cast<double>(1 << 29);

// Forward (f32 and f64), backward and 10 AdamW steps against the fixture; the f32 model runs on
// `dev`, the f64 twin on the CPU.
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
  std::int64_t counted = 0;
  for (std::int32_t t : f.targets) counted += t >= 0;
  const auto vocab = static_cast<std::int64_t>(f.config["vocab_size"]);
  const std::vector<double>& logits32 = f.ref.at("logits").data;
  const std::vector<double>& logits64 = f.ref.at("logits_f64").data;
  const double loss64 = f.ref.at("loss_f64").data[0];
  // Torch's own f32 error on the logits: the scale of this forward's rounding.
  const tests::rounding_verdict torch32 = tests::as_accurate_as(logits32, logits32, logits64);

  // MoE models: HF's loss includes coef * aux, the load balancing loss of the routers. Ours is
  // checked on its own (below) and its difference from the exact aux, times coef, widens the loss
  // bounds, which otherwise account for the cross-entropy's rounding only.
  double coef = 0;
  if constexpr (requires(const Model& m) { m.aux_loss(); })
    coef = f.config.value("output_router_logits", false)
               ? static_cast<double>(f.config["router_aux_loss_coef"])
               : 0.0;

  // Our f64 twin against torch's float64: the same function to f64 rounding, which is torch's f32
  // error scaled by 2^-29 (default_k for the difference of kernels, 2 for the two sides).
  Model m64(cfg, {f.b, f.t}, dtype::f64);
  load_weights(m64, f, map);
  m64.memory().zero_grads();
  {
    INFO("f64 forward");
    const double loss = m64.forward(ids_host, targets_host);
    const double bound64 =
        2 * tests::default_k * f64_over_f32 *
        std::max(torch32.err_ref, tests::default_floor * tests::f32_u * torch32.scale);
    const std::vector<double> ours64 = logits_of(m64.logits());
    double err64 = 0;
    for (std::size_t i = 0; i < ours64.size(); ++i)
      err64 = std::max(err64, std::abs(ours64[i] - logits64[i]));
    INFO("max |logits - torch's float64| " << err64 << ", bound " << bound64 << "; loss " << loss
                                           << " vs " << loss64);
    CHECK(err64 <= bound64);
    double aux_err = 0;
    if constexpr (requires(const Model& m) { m.aux_loss(); }) {
      // The aux loss: a sum over layers x rows x experts of router probabilities; ours against
      // torch's float64 within torch's own f32 error on it scaled to f64 (as the logits above).
      const double aux64 = f.ref.at("aux_f64").data[0], aux32 = f.ref.at("aux").data[0];
      aux_err = std::abs(m64.aux_loss() - aux64);
      const double aux_bound =
          2 * tests::default_k * f64_over_f32 *
          std::max(std::abs(aux32 - aux64), tests::default_floor * tests::f32_u * std::abs(aux64));
      INFO("aux loss " << m64.aux_loss() << " vs torch's float64 " << aux64 << ", bound "
                       << aux_bound);
      CHECK(aux_err <= aux_bound);
    }
    CHECK(std::abs(loss - loss64) <=
          loss_bound(err64, loss64, vocab, counted, tests::f32_u * f64_over_f32) + coef * aux_err);
  }
  m64.backward();

  Model model(cfg, {f.b, f.t}, dtype::f32, dev);
  load_weights(model, f, map);
  model.memory().zero_grads();
  {
    INFO("f32 forward");
    const double loss = model.forward(ids, targets);
    const auto v = tests::as_accurate_as(logits_of(model.logits()), logits32, logits64);
    INFO("logits: " << v.str() << "; loss " << loss << " vs " << loss64);
    CHECK(v.ok());
    double aux_err = 0;
    if constexpr (requires(const Model& m) { m.aux_loss(); }) {
      const std::vector<double> aux{model.aux_loss()};
      const auto a = tests::as_accurate_as(aux, f.ref.at("aux").data, f.ref.at("aux_f64").data);
      INFO("aux loss: " << a.str());
      CHECK(a.ok());
      aux_err = a.err_got;
    }
    CHECK(std::abs(loss - loss64) <=
          loss_bound(v.err_got, loss64, vocab, counted, tests::f32_u) + coef * aux_err);
  }
  model.backward();
  const auto& slots = model.slots().slots();
  const auto& slots64 = m64.slots().slots();
  REQUIRE(slots.size() == slots64.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    const auto& s = slots[i];
    if (s.kind != slot_kind::param) continue;
    hf_name h = map(s.name);
    INFO("gradient of " << s.name << " (" << h.name << ")");
    const auto v =
        equally_accurate(in_hf_layout(*s.grad, h.transposed), f.ref.at("grad." + h.name).data,
                         in_hf_layout(*slots64[i].grad, h.transposed));
    INFO(v.str());
    CHECK(v.ok());
  }

  // 10 AdamW steps on the same batch (no clipping): the loss before each, the weights after;
  // the f64 twin takes the same steps.
  Model trained(cfg, {f.b, f.t}, dtype::f32, dev), trained64(cfg, {f.b, f.t}, dtype::f64);
  load_weights(trained, f, map);
  load_weights(trained64, f, map);
  const ops::adamw_options adamw{.beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};
  adamw_optimizer opt(trained.memory().params(), adamw), opt64(trained64.memory().params(), adamw);
  const std::vector<double>& losses = f.ref.at("losses").data;
  std::vector<double> ours_losses, exact_losses;
  for (std::size_t step = 0; step < losses.size(); ++step) {
    for (Model* m : {&trained, &trained64}) m->memory().zero_grads();
    ours_losses.push_back(trained.forward(ids, targets));
    exact_losses.push_back(trained64.forward(ids_host, targets_host));
    trained.backward();
    trained64.backward();
    opt.step(trained.memory().params(), trained.memory().grads(), 1e-3);
    opt64.step(trained64.memory().params(), trained64.memory().grads(), 1e-3);
  }
  {
    const auto v = equally_accurate(ours_losses, losses, exact_losses);
    INFO("losses of the 10 steps: " << v.str());
    CHECK(v.ok());
  }
  const auto& tslots = trained.slots().slots();
  const auto& tslots64 = trained64.slots().slots();
  for (std::size_t i = 0; i < tslots.size(); ++i) {
    const auto& s = tslots[i];
    if (s.kind != slot_kind::param) continue;
    hf_name h = map(s.name);
    INFO("weights after 10 steps: " << s.name << " (" << h.name << ")");
    std::vector<double> ours = in_hf_layout(*s.field, h.transposed);
    std::vector<double> ref = f.ref.at("final." + h.name).data;
    std::vector<double> exact = in_hf_layout(*tslots64[i].field, h.transposed);
    if (h.zero_hi > h.zero_lo) {
      // Adam turns the noise of a zero gradient into steps of up to ~lr with arbitrary signs on
      // each side (the f64 twin's too), so these elements can only be held to 2 * lr per step.
      // Their gradient must be noise in HF's numbers too: the fixture's own data, 1e-5 of the
      // tensor's largest gradient where f32 rounding leaves ~1e-7 of it.
      std::int64_t third = s.field->numel() / 3;
      const std::vector<double>& g = f.ref.at("grad." + h.name).data;
      double gmax = 0, gzero = 0;
      for (std::size_t j = 0; j < g.size(); ++j) gmax = std::max(gmax, std::abs(g[j]));
      for (std::int64_t j = h.zero_lo * third; j < h.zero_hi * third; ++j) {
        gzero = std::max(gzero, std::abs(g[j]));
        CHECK(std::abs(ours[j] - ref[j]) <= 2 * 1e-3 * static_cast<double>(losses.size()));
        ours[j] = ref[j] = exact[j];  // left out of the comparison below
      }
      CHECK(gzero <= 1e-5 * gmax);
    }
    const auto v = equally_accurate(ours, ref, exact);
    INFO(v.str());
    CHECK(v.ok());
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

// Sparse MoE checkpoints (4 experts, top-2, the aux loss in the loss with coefficient 0.05):
// Mixtral renormalises the chosen experts' weights; Qwen2-MoE does not (norm_topk_prob false) and
// adds a shared expert behind a sigmoid gate, with q, k, v biases. The fixtures' routing is far
// from ties in every forward (route_gap), so f32 and f64 route every token alike.
moe_config moe_config_of(const nlohmann::json& c) {
  const bool qwen = c["model_type"] == "qwen2_moe";
  return {.vocab = c["vocab_size"],
          .dim = c["hidden_size"],
          .n_layer = c["num_hidden_layers"],
          .n_head = c["num_attention_heads"],
          .n_kv_head = c["num_key_value_heads"],
          .rms_eps = c["rms_norm_eps"],
          .rope_theta = c["rope_theta"],
          .max_seq = c["max_position_embeddings"],
          .tie_embeddings = c["tie_word_embeddings"],
          .qkv_bias = qwen,
          .expert_hidden = qwen ? c["moe_intermediate_size"] : c["intermediate_size"],
          .n_expert = qwen ? c["num_experts"] : c["num_local_experts"],
          .top_k = c["num_experts_per_tok"],
          .norm_topk_prob = qwen ? c["norm_topk_prob"].get<bool>() : true,
          .shared_hidden = qwen ? c["shared_expert_intermediate_size"].get<std::int64_t>() : 0,
          .router_aux_loss_coef = c["router_aux_loss_coef"],
          .aux_loss = c["output_router_logits"]};
}

TEST_CASE("Mixtral matches Hugging Face MixtralForCausalLM in forward backward and AdamW",
          "[cpu]") {
  fixture f = load_fixture("mixtral_tiny");
  REQUIRE(f.config["output_router_logits"] == true);
  CHECK(f.ref.at("route_gap").data[0] >= 1e-4);
  check_model<moe>(f, moe_config_of(f.config), mixtral_name);
}

TEST_CASE("Qwen2-MoE matches Hugging Face Qwen2MoeForCausalLM in forward backward and AdamW",
          "[cpu]") {
  fixture f = load_fixture("qwen2_moe_tiny");
  REQUIRE(f.config["output_router_logits"] == true);
  REQUIRE(f.config["norm_topk_prob"] == false);
  CHECK(f.ref.at("route_gap").data[0] >= 1e-4);
  check_model<moe>(f, moe_config_of(f.config), qwen2_moe_name);
}

// Decoding with the trunk's kv cache routes each new token alone; HF's cached steps are the
// reference (step_logits), our f64 twin the exact value.
TEST_CASE("Cached decoding of MoE models matches Hugging Face's", "[cpu]") {
  constexpr std::int64_t prompt = 3;
  for (const char* name : {"mixtral_tiny", "qwen2_moe_tiny"}) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    const moe_config cfg = moe_config_of(f.config);
    const auto map = f.config["model_type"] == "mixtral" ? mixtral_name : qwen2_moe_name;
    const auto vocab = static_cast<std::int64_t>(f.config["vocab_size"]);
    const st_tensor& hf_steps = f.ref.at("step_logits");
    REQUIRE(hf_steps.shape == std::vector<std::int64_t>{f.t - prompt + 1, f.b, vocab});
    auto decode = [&](dtype t) {
      moe m(cfg, {f.b, f.t}, t);
      load_weights(m, f, map);
      m.begin_generation(f.b, f.t);
      std::vector<double> out;
      for (std::int64_t lo = 0; lo < f.t; lo = lo == 0 ? prompt : lo + 1) {
        const std::int64_t n = lo == 0 ? prompt : 1;
        std::vector<std::int32_t> step(static_cast<std::size_t>(f.b * n));
        for (std::int64_t r = 0; r < f.b; ++r)
          for (std::int64_t i = 0; i < n; ++i) step[r * n + i] = f.ids[r * f.t + lo + i];
        tensor ids(step.data(), step.size() * 4, dtype::i32, {f.b, n});
        const std::vector<double> l = in_hf_layout(m.step_logits(ids), false);
        out.insert(out.end(), l.begin(), l.end());
      }
      return out;
    };
    const auto v = equally_accurate(decode(dtype::f32), hf_steps.data, decode(dtype::f64));
    INFO(v.str());
    CHECK(v.ok());
  }
}

// Llama 3.x checkpoints: llama3_scaled has Llama 3.1's rope_scaling (all three wavelength bands
// present) with attention and MLP biases; llama_linear linear scaling under the old "type" key;
// llama_dynamic dynamic NTK scaling that triggers (T = 8 > max_position_embeddings 4).
const char* const scaled_llamas[] = {"llama3_scaled", "llama_linear", "llama_dynamic"};

TEST_CASE(
    "Llama with rope_scaling and MLP biases matches Hugging Face in forward backward and AdamW",
    "[cpu]") {
  for (const char* name : scaled_llamas) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    llama_config cfg = llama_config_of(f.config);
    CHECK(cfg.rope_scale.type != rope_scaling::kind::none);
    if (cfg.rope_scale.type == rope_scaling::kind::dynamic)
      CHECK(f.t > cfg.rope_scale.original_max_position);
    if (std::string(name) == "llama3_scaled") CHECK((cfg.mlp_bias && cfg.attention_bias));
    check_model<llama>(f, cfg, llama_name);
  }
}

// The cos and sin tables of the scaled frequencies against HF's own (its float32 rotary module at
// positions 0..T-1, which the fixture holds): ours and HF's f32 tables are equally accurate
// against our f64 tables, both ways, so f64 formulas that were not HF's would fail (HF's f32
// tables would be far from them) and so would f32 ones.
TEST_CASE("Scaled RoPE tables match Hugging Face's rotary embedding", "[cpu]") {
  for (const char* name : scaled_llamas) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    llama_config cfg = llama_config_of(f.config);
    const std::int64_t d = cfg.dim / cfg.n_head, half = d / 2;
    const st_tensor& hf_cos = f.ref.at("rope_cos");
    const st_tensor& hf_sin = f.ref.at("rope_sin");
    REQUIRE(hf_cos.shape == std::vector<std::int64_t>{f.t, d});
    const ops::rope_options o = rope_options_for(cfg.rope_theta, cfg.rope_scale, d, f.t);
    owned_tensor c32 = empty({f.t, half}), s32 = empty({f.t, half});
    owned_tensor c64 = empty({f.t, half}, dtype::f64), s64 = empty({f.t, half}, dtype::f64);
    ops::rope_tables(0, o, c32, s32);
    ops::rope_tables(0, o, c64, s64);
    // HF's [T, D] holds each pair's value twice (cat(freqs, freqs)): the first half is ours.
    auto first_half = [&](const st_tensor& t) {
      std::vector<double> v;
      for (std::int64_t p = 0; p < f.t; ++p)
        for (std::int64_t i = 0; i < half; ++i) {
          v.push_back(t.data[p * d + i]);
          CHECK(t.data[p * d + i] == t.data[p * d + half + i]);
        }
      return v;
    };
    const auto vc = equally_accurate(in_hf_layout(c32, false), first_half(hf_cos), values(c64));
    const auto vs = equally_accurate(in_hf_layout(s32, false), first_half(hf_sin), values(s64));
    INFO("cos: " << vc.str() << "; sin: " << vs.str());
    CHECK(vc.ok());
    CHECK(vs.ok());
  }
}

// Cached decoding (models/kv_cache.hpp) against HF's with its DynamicCache: a prompt of 3, then
// one token at a time to T = 8, the last position's logits of each step. Ours in f32 and HF's are
// equally accurate against our f64 twin's decoding, both ways. With dynamic scaling this is the
// proof of which length a step uses: the positions so far (rope_scaling.hpp), so that the cached
// keys keep the theta they were rotated with; there the steps' logits differ from the full
// forward's by O(1), which the fixture shows too.
TEST_CASE("Cached decoding of scaled Llamas matches Hugging Face's", "[cpu]") {
  constexpr std::int64_t prompt = 3;
  for (const char* name : scaled_llamas) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    const llama_config cfg = llama_config_of(f.config);
    const auto vocab = static_cast<std::int64_t>(f.config["vocab_size"]);
    const st_tensor& hf_steps = f.ref.at("step_logits");
    REQUIRE(hf_steps.shape == std::vector<std::int64_t>{f.t - prompt + 1, f.b, vocab});
    auto decode = [&](dtype t) {
      llama m(cfg, {f.b, f.t}, t);
      load_weights(m, f, llama_name);
      m.begin_generation(f.b, f.t);
      std::vector<double> out;
      for (std::int64_t lo = 0; lo < f.t; lo = lo == 0 ? prompt : lo + 1) {
        const std::int64_t n = lo == 0 ? prompt : 1;
        std::vector<std::int32_t> step(static_cast<std::size_t>(f.b * n));
        for (std::int64_t r = 0; r < f.b; ++r)
          for (std::int64_t i = 0; i < n; ++i) step[r * n + i] = f.ids[r * f.t + lo + i];
        tensor ids(step.data(), step.size() * 4, dtype::i32, {f.b, n});
        const std::vector<double> l = in_hf_layout(m.step_logits(ids), false);
        out.insert(out.end(), l.begin(), l.end());
      }
      return out;
    };
    const auto v = equally_accurate(decode(dtype::f32), hf_steps.data, decode(dtype::f64));
    INFO(v.str());
    CHECK(v.ok());
    if (cfg.rope_scale.type == rope_scaling::kind::dynamic) {
      double apart = 0;  // HF's steps against its full forward at the same positions
      const std::vector<double>& full = f.ref.at("logits").data;
      for (std::int64_t s = 0; s <= f.t - prompt; ++s)
        for (std::int64_t r = 0; r < f.b; ++r)
          for (std::int64_t k = 0; k < vocab; ++k)
            apart = std::max(apart, std::abs(hf_steps.data[(s * f.b + r) * vocab + k] -
                                             full[(r * f.t + prompt - 1 + s) * vocab + k]));
      CHECK(apart > 0.1);
    }
  }
}

// The fixtures through the checkpoint reader (models/hf/): its config parsing, name maps and
// Conv1D transposes give the same parameters as this file's plain reader and the names above.
TEST_CASE("HF fixture folders load through the checkpoint reader to the same parameters", "[cpu]") {
  for (const char* name : {"gpt2", "llama", "llama_tied", "llama_theta_bias", "llama3_scaled",
                           "llama_linear", "llama_dynamic", "mixtral_tiny", "qwen2_moe_tiny"}) {
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
    } else if (const auto* m = std::get_if<hf::moe_config>(&hf_cfg.value())) {
      const moe_config cfg = moe_config_of(f.config), via_hf = to_moe_config(*m);
      CHECK(via_hf.expert_hidden == cfg.expert_hidden);
      CHECK(via_hf.n_expert == cfg.n_expert);
      CHECK(via_hf.norm_topk_prob == cfg.norm_topk_prob);
      CHECK(via_hf.shared_hidden == cfg.shared_hidden);
      CHECK(via_hf.qkv_bias == cfg.qkv_bias);
      CHECK(via_hf.aux_loss == cfg.aux_loss);
      CHECK(via_hf.router_aux_loss_coef == cfg.router_aux_loss_coef);
      moe a(via_hf, {f.b, f.t}, dtype::f64), b(cfg, {f.b, f.t}, dtype::f64);
      load_weights(b, f, f.config["model_type"] == "mixtral" ? mixtral_name : qwen2_moe_name);
      compare(a, b);
    } else {
      llama_config cfg = llama_config_of(f.config);
      const llama_config via_hf = to_llama_config(std::get<hf::llama_config>(hf_cfg.value()));
      CHECK(via_hf.rope_scale == cfg.rope_scale);
      CHECK(via_hf.max_seq == cfg.max_seq);
      CHECK(via_hf.mlp_bias == cfg.mlp_bias);
      CHECK(via_hf.attention_bias == cfg.attention_bias);
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
  for (const char* name : {"gpt2", "llama", "llama_tied", "llama_theta_bias", "llama3_scaled",
                           "llama_linear", "llama_dynamic"}) {
    INFO("fixture " << name);
    fixture f = load_fixture(name);
    if (f.config["model_type"] == "gpt2")
      check_model<gpt>(f, gpt2_config(f.config), gpt2_name, device::cuda());
    else
      check_model<llama>(f, llama_config_of(f.config), llama_name, device::cuda());
  }
}
