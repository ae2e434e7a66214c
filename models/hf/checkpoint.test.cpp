// HF checkpoint folders: folders written by transformers load into the GPT model with HF's layout,
// GPT-2 and Llama round trips (single file and sharded), every malformed folder rejected with the
// file and tensor named, and saves that fail without harming the previous checkpoint.
#include <catch2/catch.hpp>

#include <fmt/core.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>

#include "memory/gpu.hpp"
#include "models/gpt.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/file_io.hpp"
#include "models/hf/safetensors.hpp"
#include "models/hf/testing.hpp"
#include "models/hf/training_state.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::hf;
using namespace troupe::models::hf::testing;
using Catch::Contains;

namespace {

double element(const tensor& t, std::int64_t i) {
  return t.type() == dtype::f64 ? t.data_as<double>()[i] : t.data_as<float>()[i];
}

// The fixture's weights (see scripts/reference/make_safetensors_fixture.py): the tensor at
// position s of the sorted HF names has ((31 s + 7 k) % 97 - 48) / 64 at flat index k of HF's
// layout. Checks every parameter of the model against that, undoing the Conv1D transposes.
void check_fixture_weights(const name_map& map, const slot_list& slots) {
  std::vector<std::string> names;
  for (const auto& e : map.entries)
    if (!e.tied) names.push_back(e.hf_name);
  std::sort(names.begin(), names.end());
  std::size_t checked = 0;
  for (const auto& slot : slots.slots()) {
    if (slot.kind != slot_kind::param) continue;
    const name_map_entry* e = nullptr;
    for (const auto& x : map.entries)
      if (!x.tied && x.our_name == slot.name) e = &x;
    REQUIRE(e != nullptr);
    const auto s = std::find(names.begin(), names.end(), e->hf_name) - names.begin();
    const tensor& p = *slot.field;
    const std::int64_t cols = p.dim() == 2 ? p.size(1) : p.numel();
    for (std::int64_t i = 0; i < p.numel(); ++i) {
      // Ours [out, in] at (r, c) is HF's [in, out] at (c, r) when transposed.
      const std::int64_t r = i / cols, c = i % cols;
      const std::int64_t k = e->transpose ? c * p.size(0) + r : i;
      const double want = static_cast<double>((31 * s + 7 * k) % 97 - 48) / 64;
      if (element(p, i) != want) {
        FAIL_CHECK(slot.name << "[" << i << "] = " << element(p, i) << ", want " << want);
        return;
      }
    }
    ++checked;
  }
  CHECK(checked == names.size());
}

gpt2_config tiny_gpt2() {
  return {.vocab_size = 20, .n_positions = 8, .n_embd = 16, .n_layer = 2, .n_head = 2};
}

std::string param_bytes(gpt& m) {
  tensor flat = m.memory().params();
  owned_tensor host = to_device(flat, device::cpu());
  return std::string(static_cast<const char*>(host.data()), host.nbytes());
}

// Every tensor of a file, copied out, so a test can edit the list and write it back.
struct file_copy {
  std::vector<owned_tensor> storage;
  std::vector<named_tensor> tensors;
  void add(const std::string& name, owned_tensor t) {
    storage.push_back(std::move(t));
    tensors.push_back({name, storage.back()});
  }
  void drop(const std::string& name) {
    std::erase_if(tensors, [&](const named_tensor& t) { return t.name == name; });
  }
  const tensor& get(const std::string& name) const {
    for (const auto& t : tensors)
      if (t.name == name) return t.value;
    FAIL("no tensor " << name);
    return tensors[0].value;
  }
};

file_copy copy_file(const fs::path& p) {
  auto f = safetensors_file::open(p);
  REQUIRE(f.has_value());
  file_copy c;
  for (const auto& e : f->tensors()) {
    owned_tensor t = empty(e.sizes, e.type);
    std::memcpy(t.data(), e.data, e.nbytes());
    c.add(e.name, std::move(t));
  }
  return c;
}

std::string load_error(const fs::path& folder, const model_config& cfg, const slot_list& slots) {
  auto r = load_weights(folder, cfg, slots);
  REQUIRE_FALSE(r.has_value());
  return r.error_message();
}

}  // namespace

TEST_CASE("GPT-2 folders written by transformers load with HF's layout", "[cpu]") {
  const struct {
    const char* folder;
    std::size_t files;
  } folders[] = {{"gpt2", 1}, {"gpt2_sharded", 3}, {"gpt2_bare", 1}};
  for (const auto& f : folders) {
    for (dtype t : {dtype::f32, dtype::f64}) {
      INFO(f.folder << " into " << dtype_name(t));
      const fs::path dir = fixture_dir() / f.folder;
      auto cfg = read_config(dir);
      REQUIRE(cfg.has_value());
      const auto& g = std::get<gpt2_config>(*cfg);
      gpt model(to_gpt_config(g), {1, 8}, t);
      auto read = load_weights(dir, *cfg, model.slots());
      REQUIRE(read.has_value());
      CHECK(read->size() == f.files);
      check_fixture_weights(gpt2_name_map(g), model.slots());
    }
  }
}

TEST_CASE("A GPT-2 model saved and loaded back has identical parameters", "[cpu]") {
  temp_dir dir;
  const gpt2_config g = tiny_gpt2();
  gpt a(to_gpt_config(g), {2, 8});
  a.init_weights(11);
  auto files = save_checkpoint(dir.path(), g, a.slots());
  REQUIRE(files.has_value());
  CHECK(list_files(dir.path()) == std::vector<std::string>{"config.json", "model.safetensors"});

  // HF names and layouts in the file; the tied head absent.
  auto f = safetensors_file::open(dir / "model.safetensors");
  REQUIRE(f.has_value());
  CHECK(f->metadata().at("format") == "pt");
  CHECK(f->find("lm_head.weight") == nullptr);
  CHECK(f->tensors().size() == 2 + 12 * 2 + 2);
  const safetensors_entry* c_attn = f->find("transformer.h.1.attn.c_attn.weight");
  REQUIRE(c_attn != nullptr);
  CHECK(c_attn->type == dtype::f32);
  CHECK(c_attn->sizes == shape{16, 48});
  const tensor* qkv = nullptr;
  for (const auto& s : a.slots().slots())
    if (s.name == "h.1.attn.qkv_proj.weight") qkv = s.field;
  REQUIRE(qkv != nullptr);
  const float* in_file = c_attn->view().data_as<float>();
  for (int o = 0; o < 48; ++o)
    for (int i = 0; i < 16; ++i) REQUIRE(in_file[i * 48 + o] == qkv->data_as<float>()[o * 16 + i]);

  gpt b(to_gpt_config(g), {2, 8});
  REQUIRE(load_weights(dir.path(), g, b.slots()).has_value());
  CHECK(param_bytes(a) == param_bytes(b));

  // The same loss from both.
  std::vector<std::int32_t> ids(16), tg(16);
  for (int i = 0; i < 16; ++i) ids[i] = (i * 7) % 20, tg[i] = (i * 3 + 1) % 20;
  tensor x(ids.data(), 64, dtype::i32, {2, 8}), y(tg.data(), 64, dtype::i32, {2, 8});
  CHECK(a.forward(x, y) == b.forward(x, y));
}

TEST_CASE("Weights saved as BF16 or F16 load as the rounded values", "[cpu]") {
  temp_dir dir;
  const gpt2_config g = tiny_gpt2();
  gpt a(to_gpt_config(g), {1, 8});
  a.init_weights(3);
  for (dtype t : {dtype::bf16, dtype::f16}) {
    INFO(dtype_name(t));
    REQUIRE(save_checkpoint(dir.path(), g, a.slots(), {.weights = t}).has_value());
    auto f = safetensors_file::open(dir / "model.safetensors");
    REQUIRE(f.has_value());
    CHECK(f->find("transformer.wte.weight")->type == t);
    CHECK_THAT(read_bytes(dir / "config.json"),
               Contains(t == dtype::bf16 ? "\"bfloat16\"" : "\"float16\""));
    gpt b(to_gpt_config(g), {1, 8}, dtype::f64);
    REQUIRE(load_weights(dir.path(), g, b.slots()).has_value());
    for (std::size_t i = 0; i < a.slots().slots().size(); ++i) {
      const auto& sa = a.slots().slots()[i];
      if (sa.kind != slot_kind::param) continue;
      const tensor& pb = *b.slots().slots()[i].field;
      for (std::int64_t k = 0; k < pb.numel(); ++k) {
        const float v = sa.field->data_as<float>()[k];
        const float want = t == dtype::bf16 ? bf16_bits_to_f32(f32_to_bf16_bits(v))
                                            : f16_bits_to_f32(f32_to_f16_bits(v));
        REQUIRE(pb.data_as<double>()[k] == static_cast<double>(want));
      }
    }
  }
}

TEST_CASE("A sharded save loads back and a later single-file save replaces it", "[cpu]") {
  temp_dir dir;
  const gpt2_config g = tiny_gpt2();
  gpt a(to_gpt_config(g), {1, 8});
  a.init_weights(5);
  auto files = save_checkpoint(dir.path(), g, a.slots(), {.max_shard_bytes = 4096});
  REQUIRE(files.has_value());
  // 28 tensors, the largest 4096 bytes: several shards, every one within the limit.
  std::vector<std::string> names = list_files(dir.path());
  const int shards = static_cast<int>(names.size()) - 2;
  REQUIRE(shards > 2);
  CHECK(names[names.size() - 2] == shard_file_name(shards, shards));  // before the index
  CHECK(std::find(names.begin(), names.end(), "model.safetensors.index.json") != names.end());
  std::size_t tensors = 0;
  for (int s = 1; s <= shards; ++s) {
    auto f = safetensors_file::open(dir / shard_file_name(s, shards));
    REQUIRE(f.has_value());
    std::uint64_t bytes = 0;
    for (const auto& e : f->tensors()) bytes += e.nbytes();
    CHECK((bytes <= 4096 || f->tensors().size() == 1));
    tensors += f->tensors().size();
  }
  CHECK(tensors == 28);
  const std::string index = read_bytes(dir / "model.safetensors.index.json");
  CHECK_THAT(index,
             Contains("\"weight_map\"") && Contains("\"total_size\"") &&
                 Contains("\"transformer.ln_f.bias\": \"" + shard_file_name(shards, shards)));

  gpt b(to_gpt_config(g), {1, 8});
  auto read = load_weights(dir.path(), g, b.slots());
  REQUIRE(read.has_value());
  CHECK(read->size() == static_cast<std::size_t>(shards));
  CHECK(param_bytes(a) == param_bytes(b));

  a.init_weights(6);
  REQUIRE(save_checkpoint(dir.path(), g, a.slots()).has_value());
  CHECK(list_files(dir.path()) == std::vector<std::string>{"config.json", "model.safetensors"});
  REQUIRE(load_weights(dir.path(), g, b.slots()).has_value());
  CHECK(param_bytes(a) == param_bytes(b));
}

TEST_CASE("Malformed checkpoint folders are rejected naming the file and the tensor", "[cpu]") {
  temp_dir dir;
  const gpt2_config g = tiny_gpt2();
  gpt a(to_gpt_config(g), {1, 8});
  a.init_weights(7);
  REQUIRE(save_checkpoint(dir.path(), g, a.slots()).has_value());
  const fs::path file = dir / "model.safetensors";
  file_copy c = copy_file(file);
  gpt b(to_gpt_config(g), {1, 8});
  b.init_weights(8);
  const std::string before = param_bytes(b);
  auto rewrite = [&] { REQUIRE(save_safetensors(file, c.tensors).has_value()); };

  SECTION("a missing tensor") {
    c.drop("transformer.h.1.ln_2.bias");
    rewrite();
    CHECK_THAT(load_error(dir.path(), g, b.slots()), Contains("missing") &&
                                                         Contains(file.string()) &&
                                                         Contains("'transformer.h.1.ln_2.bias'"));
  }
  SECTION("an unexpected tensor") {
    c.add("transformer.h.0.attn.extra.weight", zeros({3}));
    rewrite();
    CHECK_THAT(load_error(dir.path(), g, b.slots()),
               Contains(file.string()) && Contains("does not have") &&
                   Contains("'transformer.h.0.attn.extra.weight'"));
  }
  SECTION("a shape that disagrees with config.json") {
    c.drop("transformer.wpe.weight");
    c.add("transformer.wpe.weight", zeros({16, 16}));
    rewrite();
    CHECK_THAT(load_error(dir.path(), g, b.slots()),
               Contains(file.string()) && Contains("tensor 'transformer.wpe.weight'") &&
                   Contains("shape [16, 16] but config.json implies [8, 16]"));
  }
  SECTION("an integer tensor where a parameter belongs") {
    c.drop("transformer.ln_f.bias");
    c.add("transformer.ln_f.bias", zeros({16}, dtype::i32));
    rewrite();
    CHECK_THAT(load_error(dir.path(), g, b.slots()),
               Contains("tensor 'transformer.ln_f.bias'") && Contains("dtype I32"));
  }
  SECTION("a tensor present with and without the optional prefix") {
    c.add("wte.weight", to_device(c.get("transformer.wte.weight"), device::cpu()));
    rewrite();
    CHECK_THAT(load_error(dir.path(), g, b.slots()),
               Contains("'transformer.wte.weight' appears twice"));
  }
  SECTION("a corrupt file") {
    std::string bytes = read_bytes(file);
    write_bytes(file, bytes.substr(0, bytes.size() - 100));
    CHECK_THAT(load_error(dir.path(), g, b.slots()),
               Contains(file.string()) && Contains("truncated"));
  }
  SECTION("no weight files") {
    fs::remove(file);
    CHECK_THAT(load_error(dir.path(), g, b.slots()),
               Contains(dir.path().string()) && Contains("has neither model.safetensors"));
  }
  SECTION("a model of another shape") {
    gpt2_config other = g;
    other.n_embd = 8;
    gpt small(to_gpt_config(other), {1, 8});
    CHECK_THAT(load_error(dir.path(), g, small.slots()),
               Contains("parameter 'wte.weight'") && Contains("the config implies [20, 16]"));
    other = g;
    other.n_layer = 3;
    gpt deep(to_gpt_config(other), {1, 8});
    CHECK_THAT(load_error(dir.path(), other, deep.slots()),
               Contains("missing") && Contains("'transformer.h.2.ln_1.weight'"));
  }
  // Nothing was written into the model by a failed load.
  CHECK(param_bytes(b) == before);
}

TEST_CASE("Ignorable buffers and a stored tied head are accepted", "[cpu]") {
  temp_dir dir;
  const gpt2_config g = tiny_gpt2();
  gpt a(to_gpt_config(g), {1, 8});
  a.init_weights(9);
  REQUIRE(save_checkpoint(dir.path(), g, a.slots()).has_value());
  file_copy c = copy_file(dir / "model.safetensors");
  c.add("transformer.h.0.attn.masked_bias", zeros({1}));
  c.add("h.1.attn.bias", zeros({1, 1, 8, 8}));
  c.add("lm_head.weight", to_device(c.get("transformer.wte.weight"), device::cpu()));
  REQUIRE(save_safetensors(dir / "model.safetensors", c.tensors).has_value());
  gpt b(to_gpt_config(g), {1, 8});
  REQUIRE(load_weights(dir.path(), g, b.slots()).has_value());
  CHECK(param_bytes(a) == param_bytes(b));
}

TEST_CASE("Broken shard indexes are rejected naming the index and the shard", "[cpu]") {
  temp_dir dir;
  const gpt2_config g = tiny_gpt2();
  gpt a(to_gpt_config(g), {1, 8});
  a.init_weights(10);
  REQUIRE(save_checkpoint(dir.path(), g, a.slots(), {.max_shard_bytes = 4096}).has_value());
  const int shards = static_cast<int>(list_files(dir.path()).size()) - 2;
  const fs::path index = dir / "model.safetensors.index.json";
  const std::string text = read_bytes(index);
  gpt b(to_gpt_config(g), {1, 8});
  auto error = [&] { return load_error(dir.path(), g, b.slots()); };

  SECTION("a shard that does not exist") {
    fs::remove(dir / shard_file_name(2, shards));
    CHECK_THAT(error(), Contains(index.string()) && Contains(shard_file_name(2, shards)) &&
                            Contains("does not exist"));
  }
  SECTION("a tensor the index puts in the wrong shard") {
    const std::string key = "\"transformer.ln_f.bias\": \"";
    write_bytes(index, replace_first(text, key + shard_file_name(shards, shards),
                                     key + shard_file_name(1, shards)));
    CHECK_THAT(error(), Contains("'transformer.ln_f.bias'") && Contains("does not hold it"));
  }
  SECTION("an index that is not JSON or has no weight_map") {
    write_bytes(index, "{\"weight_map\": ");
    CHECK_THAT(error(), Contains(index.string()) && Contains("not valid JSON"));
    write_bytes(index, "{\"metadata\": {}}");
    CHECK_THAT(error(), Contains(index.string()) && Contains("weight_map"));
  }
  SECTION("a shard outside the folder") {
    const std::string shard = shard_file_name(1, shards);
    write_bytes(index, replace_first(text, shard, "../" + shard));
    CHECK_THAT(error(), Contains("is not a file name in the folder"));
  }
}

TEST_CASE("Llama name maps round trip with tied and untied heads", "[cpu]") {
  for (bool tied : {false, true}) {
    for (bool bias : {false, true}) {
      INFO("tied " << tied << " bias " << bias);
      llama_config c{.vocab_size = 30,
                     .hidden_size = 16,
                     .intermediate_size = 24,
                     .num_hidden_layers = 2,
                     .num_attention_heads = 4,
                     .num_key_value_heads = 2,
                     .head_dim = 4,
                     .max_position_embeddings = 32,
                     .rms_norm_eps = 1e-5,
                     .tie_word_embeddings = tied,
                     .attention_bias = bias,
                     .mlp_bias = bias};
      // A stand-in for the model: one parameter per map entry, with our names and shapes.
      const name_map map = llama_name_map(c);
      auto make = [&](std::vector<tensor>& values, std::vector<tensor>& grads, slot_list& s) {
        values.resize(map.entries.size());
        grads.resize(map.entries.size());
        for (std::size_t i = 0; i < map.entries.size(); ++i)
          if (!map.entries[i].tied)
            s.param(map.entries[i].our_name, map.entries[i].hf_shape, values[i], grads[i]);
      };
      std::vector<tensor> va, ga, vb, gb;
      slot_list sa, sb;
      make(va, ga, sa);
      make(vb, gb, sb);
      layer_memory ma(sa, dtype::f32), mb(sb, dtype::f32);
      std::mt19937 rng(1);
      for (const auto& slot : sa.slots()) {
        float* p = slot.field->data_as<float>();
        for (std::int64_t i = 0; i < slot.field->numel(); ++i)
          p[i] = static_cast<float>(rng()) / 7e8f;
      }

      temp_dir dir;
      REQUIRE(save_checkpoint(dir.path(), c, sa).has_value());
      auto f = safetensors_file::open(dir / "model.safetensors");
      REQUIRE(f.has_value());
      CHECK((f->find("lm_head.weight") != nullptr) == !tied);
      CHECK((f->find("model.layers.1.self_attn.o_proj.bias") != nullptr) == bias);
      CHECK((f->find("model.layers.1.mlp.up_proj.bias") != nullptr) == bias);
      if (bias) CHECK(f->find("model.layers.0.mlp.down_proj.bias")->sizes == shape{16});
      REQUIRE(f->find("model.layers.1.self_attn.k_proj.weight") != nullptr);
      CHECK(f->find("model.layers.1.self_attn.k_proj.weight")->sizes == shape{8, 16});
      CHECK(f->find("model.layers.0.mlp.down_proj.weight")->sizes == shape{16, 24});
      CHECK(f->find("model.norm.weight") != nullptr);
      REQUIRE(load_weights(dir.path(), c, sb).has_value());
      CHECK(std::memcmp(ma.params().data(), mb.params().data(), ma.param_bytes()) == 0);
    }
  }
}

TEST_CASE("A checkpoint save that fails keeps the previous checkpoint whole", "[cpu]") {
  temp_dir dir;
  const gpt2_config g = tiny_gpt2();
  gpt a(to_gpt_config(g), {1, 8});
  a.init_weights(12);
  for (std::uint64_t shard : {std::uint64_t{0}, std::uint64_t{4096}}) {
    INFO("max_shard_bytes " << shard);
    REQUIRE(save_checkpoint(dir.path(), g, a.slots(), {.max_shard_bytes = shard}).has_value());
    const std::vector<std::string> files = list_files(dir.path());
    const std::string saved = param_bytes(a);
    gpt other(to_gpt_config(g), {1, 8});
    other.init_weights(13);
    expected<std::vector<fs::path>> r = std::vector<fs::path>{};
    {
      file_size_limit limit(shard == 0 ? 4096 : 3000);  // the single file, or a later shard
      r = save_checkpoint(dir.path(), g, other.slots(), {.max_shard_bytes = shard});
    }
    REQUIRE_FALSE(r.has_value());
    CHECK_THAT(r.error_message(), Contains(".tmp") && Contains("cannot write"));
    CHECK(list_files(dir.path()) == files);  // no temporary files, nothing renamed
    gpt b(to_gpt_config(g), {1, 8});
    REQUIRE(load_weights(dir.path(), g, b.slots()).has_value());
    CHECK(param_bytes(b) == saved);
  }
}

TEST_CASE("A model on the GPU loads and saves the same bytes as on the CPU", "[gpu]") {
  if (!memory::gpu_available()) {
    WARN("troupe-skip: no GPU");
    return;
  }
  const fs::path src = fixture_dir() / "gpt2_sharded";
  auto cfg = read_config(src);
  REQUIRE(cfg.has_value());
  const auto g = std::get<gpt2_config>(*cfg);
  gpt cpu(to_gpt_config(g), {1, 8}), gpu(to_gpt_config(g), {1, 8}, dtype::f32, device::cuda());
  REQUIRE(load_weights(src, *cfg, cpu.slots()).has_value());
  REQUIRE(load_weights(src, *cfg, gpu.slots()).has_value());
  CHECK(param_bytes(gpu) == param_bytes(cpu));
  temp_dir a, b;
  REQUIRE(save_checkpoint(a.path(), g, cpu.slots()).has_value());
  REQUIRE(save_checkpoint(b.path(), g, gpu.slots()).has_value());
  CHECK(read_bytes(a / "model.safetensors") == read_bytes(b / "model.safetensors"));
}

// A checkpoint folder is replaced as one unit: a writer that fails half way (a full disk) leaves
// the previous checkpoint byte for byte and no partial folder; a writer that succeeds replaces it.
TEST_CASE("A failed save leaves the previous checkpoint folder as it was", "[cpu]") {
  temp_dir tmp;
  const fs::path ck = tmp.path() / "ck";
  auto write_files = [](const std::string& text) {
    return [text](const fs::path& dir) -> expected<fs::path> {
      fs::create_directories(dir);
      std::ofstream(dir / "model.safetensors") << text;
      std::ofstream(dir / "optimizer.safetensors") << text;
      return dir;
    };
  };
  auto read = [](const fs::path& f) {
    std::ifstream in(f);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  REQUIRE(save_folder_atomically(ck, write_files("step 1")).has_value());
  CHECK(read(ck / "optimizer.safetensors") == "step 1");
  auto failed = save_folder_atomically(ck, [](const fs::path& dir) -> expected<fs::path> {
    fs::create_directories(dir);
    std::ofstream(dir / "model.safetensors") << "step 2";
    return expected<fs::path>::failure("writing optimizer.safetensors: No space left on device");
  });
  REQUIRE_FALSE(failed.has_value());
  CHECK_THAT(failed.error_message(),
             Catch::Contains("No space left") && Catch::Contains("unchanged"));
  CHECK(read(ck / "model.safetensors") == "step 1");
  CHECK(read(ck / "optimizer.safetensors") == "step 1");
  CHECK_FALSE(fs::exists(tmp.path() / "ck.partial"));
  REQUIRE(save_folder_atomically(ck / "", write_files("step 3")).has_value());
  CHECK(read(ck / "model.safetensors") == "step 3");
  CHECK_FALSE(fs::exists(tmp.path() / "ck.old"));
  CHECK_FALSE(fs::exists(tmp.path() / "ck.partial"));
  // Where the file system cannot swap two folders in one rename: the two renames via ck.old.
  std::ofstream(stage_folder(ck) / "model.safetensors") << "step 4";
  publish_folder(ck, false);
  CHECK(read(ck / "model.safetensors") == "step 4");
  CHECK_FALSE(fs::exists(tmp.path() / "ck.old"));
  CHECK_FALSE(fs::exists(tmp.path() / "ck.partial"));
  // Into a folder whose parents do not exist yet.
  REQUIRE(save_folder_atomically(tmp.path() / "runs" / "a" / "ck", write_files("x")).has_value());
  CHECK(read(tmp.path() / "runs" / "a" / "ck" / "model.safetensors") == "x");
}

// The one state a crash can leave without `folder` (a file system without RENAME_EXCHANGE, cut off
// between moving the previous checkpoint to `<folder>.old` and the new one into place): resuming
// `folder` fails naming `<folder>.old`, and the next save removes it once it replaced it.
TEST_CASE("Resuming a folder whose save was cut off between its renames names the old folder",
          "[cpu]") {
  temp_dir tmp;
  const fs::path ck = tmp.path() / "ck", old = tmp.path() / "ck.old";
  auto files = [](const fs::path& dir) -> expected<fs::path> {
    std::ofstream(dir / "config.json") << "{}";
    return dir;
  };
  REQUIRE(save_folder_atomically(ck, files).has_value());
  fs::rename(ck, old);
  // (fmt rather than "'" + path.string(): GCC 12 at -O3 warns -Wrestrict inside that operator+.)
  const std::string old_there = fmt::format("'{}' is there", old.string()),
                    rename_back = fmt::format("rename it to '{}'", ck.string());
  auto config = read_config(ck);
  REQUIRE_FALSE(config.has_value());
  CHECK_THAT(config.error_message(), Contains(old_there) && Contains(rename_back));
  auto state = training_state_file::open(ck, shape{4});
  REQUIRE_FALSE(state.has_value());
  CHECK_THAT(state.error_message(), Contains(old_there));
  // A folder that merely does not exist gets no such note.
  auto other = read_config(tmp.path() / "other");
  REQUIRE_FALSE(other.has_value());
  CHECK_THAT(other.error_message(), !Contains(".old"));
  REQUIRE(save_folder_atomically(ck, files).has_value());
  CHECK(fs::exists(ck / "config.json"));
  CHECK_FALSE(fs::exists(old));
}
