// Loading and saving HF model folders (see checkpoint.hpp).
#include "models/hf/checkpoint.hpp"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "memory/gpu.hpp"
#include "models/hf/bounded_json.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/hf/file_io.hpp"
#include "models/hf/safetensors.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::hf {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// model.safetensors, model-00001-of-00005.safetensors, and either with .index.json after it.
bool is_weight_file_name(std::string_view n) {
  constexpr std::string_view ext = ".safetensors", index = ".index.json";
  if (n.size() > index.size() && n.substr(n.size() - index.size()) == index)
    n.remove_suffix(index.size());
  if (n.size() < ext.size() || n.substr(n.size() - ext.size()) != ext) return false;
  n.remove_suffix(ext.size());
  if (n == "model") return true;
  auto digits = [](std::string_view d) {
    return d.size() == 5 && d.find_first_not_of("0123456789") == std::string_view::npos;
  };
  // "model-" 5 digits "-of-" 5 digits
  return n.size() == 20 && n.substr(0, 6) == "model-" && digits(n.substr(6, 5)) &&
         n.substr(11, 4) == "-of-" && digits(n.substr(15, 5));
}

constexpr const char* single_file = "model.safetensors";
constexpr const char* index_file = "model.safetensors.index.json";

// A tensor found in the folder: the file it lives in and its entry there.
struct found_tensor {
  const safetensors_file* file;
  const safetensors_entry* entry;
};

// The weight files of a folder, opened and validated, with every tensor by its name in the file.
struct weight_files {
  std::vector<safetensors_file> files;
  std::map<std::string, found_tensor> tensors;
  std::string origin;  // for "missing" errors: "model.safetensors" or the index
};

safetensors_file open_or_fail(const fs::path& p) {
  auto f = safetensors_file::open(p);
  if (!f) fail(f.error_message());
  return std::move(f).value();
}

// Reads model.safetensors.index.json: tensor name -> shard file name.
std::map<std::string, std::string> read_index(const fs::path& path) {
  const std::string where = "index '" + path.string() + "'";
  const json j = parse_bounded_json<json>(read_bounded_text(path, index_json_bounds),
                                          index_json_bounds, where);
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object())
    fail(where, ": needs an object \"weight_map\" of tensor name -> shard file");
  std::map<std::string, std::string> map;
  for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
    if (!it.value().is_string())
      fail(where, ", tensor '", it.key(), "': the shard must be a file name, got ",
           it.value().dump());
    std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..")
      fail(where, ", tensor '", it.key(), "': shard '", shard,
           "' is not a file name in the folder");
    map[it.key()] = std::move(shard);
  }
  return map;
}

weight_files open_weight_files(const fs::path& folder) {
  weight_files w;
  const fs::path index = folder / index_file;
  if (fs::exists(index)) {
    w.origin = "the shards of " + in_quotes(index.string());
    auto map = read_index(index);
    std::map<std::string, std::size_t> shard_of_name;  // shard file -> position in w.files
    for (const auto& [tensor_name, shard] : map) {
      if (shard_of_name.count(shard) != 0) continue;
      const fs::path p = folder / shard;
      if (!fs::exists(p))
        fail("index '", index.string(), "' puts tensor '", tensor_name, "' in shard '", shard,
             "', which does not exist");
      shard_of_name[shard] = w.files.size();
      w.files.push_back(open_or_fail(p));
    }
    for (const auto& [tensor_name, shard] : map) {
      const safetensors_file& f = w.files[shard_of_name[shard]];
      const safetensors_entry* e = f.find(tensor_name);
      if (e == nullptr)
        fail("index '", index.string(), "' puts tensor '", tensor_name, "' in shard '",
             f.path().string(), "', which does not hold it");
      w.tensors[tensor_name] = {&f, e};
    }
    for (const auto& f : w.files)
      for (const auto& e : f.tensors())
        if (map.count(e.name) == 0)
          fail("shard '", f.path().string(), "' holds tensor '", e.name, "', which index '",
               index.string(), "' does not list");
        else if (map.at(e.name) != f.path().filename().string())
          fail("shard '", f.path().string(), "' holds tensor '", e.name, "', which index '",
               index.string(), "' puts in '", map.at(e.name), "'");
    return w;
  }
  const fs::path single = folder / single_file;
  if (!fs::exists(single))
    fail("checkpoint folder '", folder.string(), "' has neither ", single_file, " nor ",
         index_file);
  w.origin = in_quotes(single.string());
  w.files.push_back(open_or_fail(single));
  for (const auto& e : w.files[0].tensors()) w.tensors[e.name] = {&w.files[0], &e};
  return w;
}

std::string list_names(const std::vector<std::string>& names) {
  std::string s;
  const std::size_t shown = std::min<std::size_t>(names.size(), 8);
  for (std::size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + in_quotes(names[i]);
  if (names.size() > shown) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return s;
}

shape transposed(const shape& s) {
  return s.rank() == 2 ? shape{s[1], s[0]} : s;
}

std::map<std::string, const tensor_slot*> param_slots(const slot_list& slots) {
  std::map<std::string, const tensor_slot*> out;
  for (const auto& s : slots.slots())
    if (s.kind == slot_kind::param) out[s.name] = &s;
  return out;
}

// Checks the name map against the model's parameters: every non-tied entry names a parameter of
// the right shape (bound to memory when `bound`), and every parameter has an entry.
void check_map_against_model(const name_map& map,
                             const std::map<std::string, const tensor_slot*>& params,
                             bool bound = true) {
  std::set<std::string> covered;
  for (const auto& e : map.entries) {
    if (e.tied) continue;
    auto it = params.find(e.our_name);
    if (it == params.end())
      fail("the model has no parameter '", e.our_name, "' (for HF tensor '", e.hf_name, "')");
    const shape want = e.transpose ? transposed(e.hf_shape) : e.hf_shape;
    if (!(it->second->sizes == want))
      fail("parameter '", e.our_name, "' of the model has shape ", it->second->sizes.str(),
           " but the config implies ", want.str(), " (HF tensor '", e.hf_name, "' is ",
           e.hf_shape.str(), ")");
    if (bound && (it->second->field == nullptr || !it->second->field->defined()))
      fail("parameter '", e.our_name, "' of the model has no memory bound yet");
    covered.insert(e.our_name);
  }
  for (const auto& [name, slot] : params)
    if (covered.count(name) == 0)
      fail("parameter '", name, "' of the model has no HF tensor in the name map");
}

}  // namespace

std::string shard_file_name(int index, int count) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05d-of-%05d.safetensors", index, count);
  return buf;
}

expected<std::vector<fs::path>> load_weights(const fs::path& folder, const name_map& map,
                                             const slot_list& slots) {
  const auto params = param_slots(slots);
  return read_weights(
      folder, map, slots,
      [&](const name_map_entry& e, const safetensors_entry& t) {
        read_into(t, *params.at(e.our_name)->field, e.transpose);
      },
      /*bound=*/true);
}

expected<std::vector<fs::path>> read_weights(const fs::path& folder, const name_map& map,
                                             const slot_list& slots, const weight_reader& each,
                                             bool bound) {
  return as_expected([&] {
    const auto params = param_slots(slots);
    check_map_against_model(map, params, bound);
    weight_files w = open_weight_files(folder);

    // Match every tensor of the folder to the map.
    std::map<const name_map_entry*, std::pair<std::string, found_tensor>> matched;
    std::vector<std::string> unexpected;
    const safetensors_file* unexpected_file = nullptr;
    for (const auto& [name, found] : w.tensors) {
      const name_map_entry* e = map.match(name);
      if (e == nullptr) {
        if (map.ignorable(name)) continue;
        if (unexpected.empty()) unexpected_file = found.file;
        unexpected.push_back(name);
        continue;
      }
      if (e->tied) continue;
      auto [it, fresh] = matched.emplace(e, std::make_pair(name, found));
      if (!fresh)
        fail("tensor '", e->hf_name, "' appears twice, as '", it->second.first, "' in '",
             it->second.second.file->path().string(), "' and as '", name, "' in '",
             found.file->path().string(), "'");
    }
    if (!unexpected.empty())
      fail("'", unexpected_file->path().string(),
           "' holds tensors the model does not have: ", list_names(unexpected));
    std::vector<std::string> missing;
    for (const auto& e : map.entries)
      if (!e.tied && matched.count(&e) == 0) missing.push_back(e.hf_name);
    if (!missing.empty()) fail("tensors missing from ", w.origin, ": ", list_names(missing));

    // Check every dtype and shape before the first byte is written into the model.
    for (const auto& [e, named] : matched) {
      const safetensors_entry& t = *named.second.entry;
      const std::string where =
          in_quotes(named.second.file->path().string()) + ", tensor " + in_quotes(named.first);
      if (!is_floating(t.type))
        fail(where, ": dtype ", safetensors_dtype_name(t.type), " cannot hold a parameter");
      if (!(t.sizes == e->hf_shape))
        fail(where, ": shape ", t.sizes.str(), " but config.json implies ", e->hf_shape.str());
    }
    for (const auto& [e, named] : matched) each(*e, *named.second.entry);
    if (bound && !params.empty() && !params.begin()->second->field->is_cpu())
      memory::device_synchronize();

    std::vector<fs::path> read;
    for (const auto& f : w.files) read.push_back(f.path());
    return read;
  });
}

expected<std::vector<fs::path>> load_weights(const fs::path& folder, const model_config& cfg,
                                             const slot_list& slots) {
  return load_weights(folder, name_map_for(cfg), slots);
}

expected<std::vector<fs::path>> save_weights(const fs::path& folder, const name_map& map,
                                             const slot_list& slots, const save_options& opt) {
  return as_expected([&] {
    if (!is_floating(opt.weights))
      fail("save_weights: the dtype on disk must be floating, got ", dtype_name(opt.weights));
    const auto params = param_slots(slots);
    check_map_against_model(map, params);

    // Plan the shards: consecutive entries in map order, each shard at most max_shard_bytes.
    std::vector<std::vector<const name_map_entry*>> shards(1);
    std::uint64_t in_shard = 0, total = 0;
    for (const auto& e : map.entries) {
      if (e.tied) continue;
      const std::uint64_t bytes = e.hf_shape.numel() * dtype_size(opt.weights);
      if (opt.max_shard_bytes > 0 && !shards.back().empty() &&
          in_shard + bytes > opt.max_shard_bytes) {
        shards.emplace_back();
        in_shard = 0;
      }
      shards.back().push_back(&e);
      in_shard += bytes;
      total += bytes;
    }
    const bool sharded = opt.max_shard_bytes > 0;
    const int count = static_cast<int>(shards.size());

    // Write every shard to its temporary file, one shard's tensors in memory at a time.
    std::vector<atomic_file> written;
    json weight_map = json::object();
    for (int s = 0; s < count; ++s) {
      const std::string name = sharded ? shard_file_name(s + 1, count) : single_file;
      std::vector<owned_tensor> storage;
      std::vector<named_tensor> tensors;
      for (const name_map_entry* e : shards[s]) {
        const tensor& param = *params.at(e->our_name)->field;
        owned_tensor host_param;
        tensor src = param;
        if (!param.is_cpu()) {
          host_param = to_device(param, device::cpu());
          src = host_param;
        }
        owned_tensor out = empty(e->hf_shape, opt.weights);
        ops::copy(e->transpose ? src.transpose(0, 1) : src, out);
        tensors.push_back({e->hf_name, out});
        storage.push_back(std::move(out));
        weight_map[e->hf_name] = name;
      }
      written.push_back(write_safetensors(folder / name, tensors, {{"format", "pt"}}));
    }

    std::vector<fs::path> files;
    for (auto& f : written) {
      f.commit();
      files.push_back(f.path());
    }
    if (sharded) {
      json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
      write_text_file_atomically(folder / index_file, index.dump(2) + "\n");
      files.push_back(folder / index_file);
    }

    // Remove the weight files of an earlier save that this one does not use.
    std::set<fs::path> keep(files.begin(), files.end());
    for (const auto& d : fs::directory_iterator(folder)) {
      const std::string n = d.path().filename().string();
      if (is_weight_file_name(n) && keep.count(folder / n) == 0) {
        std::error_code ec;
        fs::remove(d.path(), ec);
      }
    }
    sync_directory(folder);
    return files;
  });
}

namespace {

std::vector<tensor_spec> f32_specs(const std::vector<name_map_entry>& entries) {
  std::vector<tensor_spec> specs;
  for (const auto& e : entries) specs.push_back({e.hf_name, dtype::f32, e.hf_shape});
  return specs;
}

std::vector<name_map_entry> untied(const model_config& cfg) {
  std::vector<name_map_entry> out;
  for (const auto& e : name_map_for(cfg).entries)
    if (!e.tied) out.push_back(e);
  return out;
}

}  // namespace

std::vector<name_map_entry> checkpoint_writer::order(const model_config& cfg) {
  auto entries = untied(cfg);
  std::map<std::string, name_map_entry> by_name;
  for (const auto& e : entries) by_name.emplace(e.hf_name, e);
  std::vector<name_map_entry> out;
  for (const auto& sp : safetensors_writer::file_order(f32_specs(entries)))
    out.push_back(by_name.at(sp.name));
  return out;
}

checkpoint_writer::checkpoint_writer(const fs::path& folder, const model_config& cfg)
    : folder_(folder),
      cfg_(cfg),
      order_(order(cfg)),
      file_(folder / single_file, f32_specs(order_), {{"format", "pt"}}) {
  for (std::size_t i = 0; i < order_.size(); ++i)
    TROUPE_CHECK(file_.order()[i].name == order_[i].hf_name, "checkpoint_writer: tensor ", i,
                 " of '", (folder / single_file).string(), "' is '", file_.order()[i].name,
                 "', not '", order_[i].hf_name, "'");
}

void checkpoint_writer::write(const tensor& ours) {
  TROUPE_CHECK(next_ < order_.size(), "checkpoint_writer: every tensor of '",
               (folder_ / single_file).string(), "' is written already");
  const name_map_entry& e = order_[next_];
  const shape want = e.transpose ? transposed(e.hf_shape) : e.hf_shape;
  TROUPE_CHECK(ours.sizes() == want && ours.is_cpu(), "checkpoint_writer: tensor '", e.hf_name,
               "' needs a host tensor of shape ", want.str(), ", got ", ours.describe());
  if (!out_.defined() || out_.numel() < e.hf_shape.numel())
    out_ = empty({e.hf_shape.numel()}, dtype::f32);
  tensor out = out_.narrow(0, 0, e.hf_shape.numel()).reshape(e.hf_shape);
  ops::copy(e.transpose ? ours.transpose(0, 1) : ours, out);
  file_.append(out);
  ++next_;
}

std::vector<fs::path> checkpoint_writer::commit() {
  atomic_file weights = file_.finish();
  weights.commit();
  auto config = write_config(folder_, cfg_, dtype::f32);
  if (!config) fail(config.error_message());
  return {weights.path(), *config};
}

expected<fs::path> save_folder_atomically(
    const fs::path& folder, const std::function<expected<fs::path>(const fs::path&)>& write) {
  using result = expected<fs::path>;
  auto staged = as_expected([&] { return stage_folder(folder); });
  if (!staged) return staged;
  auto written = write(*staged);
  if (!written) {
    std::error_code ec;
    fs::remove_all(*staged, ec);
    const fs::path dir = folder.has_filename() ? folder : folder.parent_path();
    const auto step = checkpoint_step(dir);
    return result::failure(written.error_message() + " (the checkpoint in '" + dir.string() + "'" +
                           (step ? ", step " + std::to_string(*step) + "," : std::string()) +
                           " is unchanged)");
  }
  return as_expected([&] {
    publish_folder(folder);
    return folder;
  });
}

expected<std::vector<fs::path>> save_checkpoint(const fs::path& folder, const model_config& cfg,
                                                const slot_list& slots, const save_options& opt) {
  std::error_code ec;
  fs::create_directories(folder, ec);
  if (ec)
    return expected<std::vector<fs::path>>::failure("cannot create checkpoint folder '" +
                                                    folder.string() + "': " + ec.message());
  auto files = save_weights(folder, name_map_for(cfg), slots, opt);
  if (!files) return files;
  auto config = write_config(folder, cfg, opt.weights);
  if (!config) return expected<std::vector<fs::path>>::failure(config.error_message());
  files->push_back(*config);
  return files;
}

}  // namespace troupe::models::hf
