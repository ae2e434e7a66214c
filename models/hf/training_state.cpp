// Saving and loading the optimizer moments and step counts (see training_state.hpp).
#include "models/hf/training_state.hpp"

#include <nlohmann/json.hpp>

#include "models/hf/bounded_json.hpp"
#include "models/hf/file_io.hpp"
#include "models/hf/safetensors.hpp"

namespace troupe::models::hf {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

constexpr const char* optimizer_file = "optimizer.safetensors";
constexpr const char* state_file = trainer_state_file_name;
constexpr const char* format_name = trainer_state_format;
constexpr std::int64_t format_version = 1;

json shape_json(const shape& s) {
  json j = json::array();
  for (auto d : s) j.push_back(d);
  return j;
}

std::int64_t count_field(const json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j[key].is_number_integer() || j[key].get<std::int64_t>() < 0)
    fail(where, ": field '", key, "' must be a non-negative integer",
         j.contains(key) ? ", got " + j[key].dump() : std::string(" (missing)"));
  return j[key].get<std::int64_t>();
}

// Checks one moment of the file against the model's (shape `want`) and trainer_state.json.
const safetensors_entry& check_moment(const safetensors_file& f, const char* name,
                                      const shape& want, const json& state,
                                      const std::string& state_where) {
  const safetensors_entry* e = f.find(name);
  const std::string where = in_quotes(f.path().string()) + ", tensor " + in_quotes(name);
  if (e == nullptr) fail("'", f.path().string(), "' has no tensor '", name, "'");
  if (!is_floating(e->type))
    fail(where, ": dtype ", safetensors_dtype_name(e->type), " cannot hold optimizer moments");
  if (!(e->sizes == want))
    fail(where, ": shape ", e->sizes.str(), " but the model's optimizer state is ", want.str(),
         " (a checkpoint of another model?)");
  if (!state.contains(name) || !state[name].is_object() || !state[name].contains("shape"))
    fail(state_where, ": field '", name, "' must describe the moment (dtype, shape)");
  if (state[name]["shape"] != shape_json(e->sizes))
    fail(state_where, ": field '", name, "' gives shape ", state[name]["shape"].dump(), " but '",
         f.path().string(), "' holds ", e->sizes.str());
  return *e;
}

}  // namespace

training_state_writer::training_state_writer(const fs::path& folder, const training_state& state,
                                             dtype type, const shape& moments)
    : folder_(folder), state_(state), type_(type), moments_(moments) {
  const json extra = json::parse(state.extra_json, nullptr, false);
  if (extra.is_discarded() || !extra.is_object())
    fail("save_training_state: extra_json must be a JSON object, got '", state.extra_json, "'");
  if (state.step < 0 || state.optimizer_steps < 0)
    fail("save_training_state: step counts must be non-negative");
  file_.emplace(folder / optimizer_file,
                std::vector<tensor_spec>{{"m", type, moments}, {"v", type, moments}},
                std::map<std::string, std::string>{{"format", format_name},
                                                   {"step", std::to_string(state.step)}});
}

void training_state_writer::append(const tensor& part) {
  file_->append(part);
}

std::vector<fs::path> training_state_writer::commit() {
  atomic_file opt = file_->finish();
  const json moment = {{"dtype", safetensors_dtype_name(type_)}, {"shape", shape_json(moments_)}};
  json j;
  j["format"] = format_name;
  j["format_version"] = format_version;
  j["step"] = state_.step;
  j["optimizer_steps"] = state_.optimizer_steps;
  j["m"] = moment;
  j["v"] = moment;
  j["extra"] = json::parse(state_.extra_json);
  atomic_file st(folder_ / state_file);
  st.write(j.dump(2) + "\n");
  st.finish();
  opt.commit();
  st.commit();
  return {opt.path(), st.path()};
}

expected<std::vector<fs::path>> save_training_state(const fs::path& folder,
                                                    const training_state& state, const tensor& m,
                                                    const tensor& v) {
  return as_expected([&] {
    owned_tensor host_m, host_v;
    auto host = [](const tensor& t, owned_tensor& storage) -> tensor {
      if (t.is_cpu() && t.is_contiguous()) return t;
      storage = to_device(t, device::cpu());
      return storage;
    };
    const tensor hm = host(m, host_m), hv = host(v, host_v);
    if (hm.type() != hv.type() || !(hm.sizes() == hv.sizes()))
      fail("save_training_state: m ", hm.describe(), " and v ", hv.describe(),
           " must have one dtype and shape");
    training_state_writer w(folder, state, hm.type(), hm.sizes());
    w.append(hm);
    w.append(hv);
    return w.commit();
  });
}

training_state_file::training_state_file(training_state s, safetensors_file f)
    : state_(std::move(s)), file_(std::move(f)) {}

expected<training_state_file> training_state_file::open(const fs::path& folder,
                                                        const shape& moments) {
  return as_expected([&] {
    const fs::path state_path = folder / state_file;
    const std::string where = in_quotes(state_path.string());
    for (const char* name : {optimizer_file, state_file})
      if (!fs::exists(folder / name))
        fail(in_quotes((folder / name).string()), ": cannot open it (no such file): not a ",
             "checkpoint to resume from; a folder of weights only starts a run with model.hf ",
             "(--model-hf)", interrupted_save_note(folder));
    const json j = parse_bounded_json<json>(read_bounded_text(state_path, trainer_state_bounds),
                                            trainer_state_bounds, where);
    if (!j.is_object()) fail(where, ": not a JSON object");
    if (!j.contains("format") || j["format"] != format_name)
      fail(where, ": field 'format' must be \"", format_name, "\"");
    if (count_field(j, "format_version", where) != format_version)
      fail(where, ": format_version ", j["format_version"].dump(), " is not supported (this build ",
           "reads version ", format_version, ")");
    training_state s;
    s.step = count_field(j, "step", where);
    s.optimizer_steps = count_field(j, "optimizer_steps", where);
    if (j.contains("extra")) {
      if (!j["extra"].is_object()) fail(where, ": field 'extra' must be a JSON object");
      s.extra_json = j["extra"].dump();
    }

    auto opened = safetensors_file::open(folder / optimizer_file);
    if (!opened) fail(opened.error_message());
    training_state_file out(std::move(s), std::move(*opened));
    const safetensors_file& f = out.file_;
    const training_state& st = out.state_;
    auto saved_step = f.metadata().find("step");
    if (saved_step == f.metadata().end() || saved_step->second != std::to_string(st.step))
      fail("'", f.path().string(), "' is from step ",
           saved_step == f.metadata().end() ? std::string("?") : saved_step->second, " but ", where,
           " is from step ", st.step, " (an interrupted save?)");
    for (const auto& e : f.tensors())
      if (e.name != "m" && e.name != "v")
        fail("'", f.path().string(), "' holds an unexpected tensor '", e.name, "'");
    out.m_ = &check_moment(f, "m", moments, j, where);
    out.v_ = &check_moment(f, "v", moments, j, where);
    return out;
  });
}

tensor training_state_file::f32_view(const safetensors_entry& moment) const {
  if (moment.type != dtype::f32 || !moment.aligned())
    fail(in_quotes(file_.path().string()), ", tensor ", in_quotes(moment.name), ": dtype ",
         safetensors_dtype_name(moment.type),
         ": a parallel plan reads optimizer moments stored as F32 only");
  return moment.view();
}

expected<training_state> load_training_state(const fs::path& folder, const tensor& m,
                                             const tensor& v) {
  return as_expected([&] {
    TROUPE_CHECK(m.sizes() == v.sizes(), "load_training_state: m ", m.describe(), " and v ",
                 v.describe(), " differ");
    auto f = training_state_file::open(folder, m.sizes());
    if (!f) fail(f.error_message());
    read_into(f->m(), m);
    read_into(f->v(), v);
    return f->state();
  });
}

}  // namespace troupe::models::hf
