// Reading (validated, memory-mapped) and writing (atomic) safetensors files.
#include "models/hf/safetensors.hpp"

#include <algorithm>
#include <cstring>
#include <limits>
#include <set>

#include <nlohmann/json.hpp>

#include "memory/gpu.hpp"
#include "models/hf/bounded_json.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::hf {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The format caps the header at 100 MB (safetensors' MAX_HEADER_SIZE).
constexpr std::uint64_t max_header_bytes = 100'000'000;

struct dtype_name_pair {
  dtype type;
  std::string_view name;
};
constexpr dtype_name_pair dtype_names[] = {
    {dtype::f32, "F32"}, {dtype::bf16, "BF16"}, {dtype::f16, "F16"}, {dtype::f64, "F64"},
    {dtype::i32, "I32"}, {dtype::i64, "I64"},   {dtype::u8, "U8"},
};

std::string shape_text(const json& j) {
  return j.dump();
}

// Reads a non-negative integer from a JSON value, or fails with `what`.
std::uint64_t as_count(const json& j, const std::string& where, std::string_view what) {
  if (j.is_number_unsigned()) return j.get<std::uint64_t>();
  if (j.is_number_integer() && j.get<std::int64_t>() >= 0)
    return static_cast<std::uint64_t>(j.get<std::int64_t>());
  fail(where, ": ", what, " must hold non-negative integers, got ", j.dump());
}

}  // namespace

std::string_view safetensors_dtype_name(dtype t) {
  for (const auto& p : dtype_names)
    if (p.type == t) return p.name;
  return "?";
}

std::optional<dtype> parse_safetensors_dtype(std::string_view name) {
  for (const auto& p : dtype_names)
    if (p.name == name) return p.type;
  return std::nullopt;
}

bool safetensors_entry::aligned() const {
  return reinterpret_cast<std::uintptr_t>(data) % dtype_size(type) == 0;
}

tensor safetensors_entry::view() const {
  TROUPE_CHECK(aligned(), "safetensors tensor '", name, "' is not aligned to its element size");
  // The mapping is read-only: the tensor is only ever read from.
  return tensor(const_cast<std::byte*>(data), nbytes(), type, sizes);
}

// ---- reading --------------------------------------------------------------------------------

expected<safetensors_file> safetensors_file::open(const fs::path& path) {
  return as_expected([&] {
    safetensors_file f;
    f.path_ = path;
    f.map_ = mapped_file(path);
    f.parse();
    return f;
  });
}

const safetensors_entry* safetensors_file::find(std::string_view name) const {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &entries_[it->second];
}

void safetensors_file::parse() {
  const std::string file = "safetensors file '" + path_.string() + "'";
  const std::uint64_t size = map_.size();
  if (size < 8)
    fail(file, ": ", size,
         " bytes, shorter than the 8-byte header length (not a safetensors file)");
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(map_.data()[i]);
  if (n > size - 8)
    fail(file, ": header length ", n, " runs past the end of the file (", size,
         " bytes; truncated, or not a safetensors file)");
  if (n > max_header_bytes)
    fail(file, ": header length ", n, " exceeds the format's limit of ", max_header_bytes);

  // Parse the header, noting duplicate tensor names (JSON objects would keep only the last).
  const char* h = reinterpret_cast<const char*>(map_.data() + 8);
  std::set<std::string> seen;
  std::string duplicate;
  json::parser_callback_t on_event = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::object_start || ev == json::parse_event_t::array_start)
      check_json_depth(depth + 1, safetensors_header_bounds, file);  // throws troupe::error
    if (ev == json::parse_event_t::key && depth == 1 &&
        !seen.insert(parsed.get<std::string>()).second)
      duplicate = parsed.get<std::string>();
    return true;
  };
  json header;
  try {
    header = json::parse(h, h + n, on_event);
  } catch (const json::exception& e) {
    fail(file, ": the header is not valid JSON (", e.what(), ")");
  }
  if (!header.is_object()) fail(file, ": the header is not a JSON object");
  if (!duplicate.empty()) fail(file, ", tensor '", duplicate, "': named twice in the header");

  const std::uint64_t data_bytes = size - 8 - n;
  const std::byte* data = map_.data() + 8 + n;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    if (name == "__metadata__") {
      if (!v.is_object()) fail(file, ": __metadata__ must be an object of strings");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string())
          fail(file, ": __metadata__ entry '", m.key(), "' must be a string, got ",
               m.value().dump());
        metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = file + ", tensor '" + name + "'";
    if (!v.is_object()) fail(where, ": the header entry is not an object");
    if (!v.contains("dtype") || !v["dtype"].is_string())
      fail(where, ": missing or non-string dtype");
    if (!v.contains("shape") || !v["shape"].is_array()) fail(where, ": missing or non-array shape");
    if (!v.contains("data_offsets") || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      fail(where, ": data_offsets must be an array [begin, end]");

    safetensors_entry e;
    e.name = name;
    const std::string dt = v["dtype"].get<std::string>();
    auto t = parse_safetensors_dtype(dt);
    if (!t) fail(where, ": unknown or unsupported dtype '", dt, "'");
    e.type = *t;
    const json& sh = v["shape"];
    if (sh.size() > static_cast<std::size_t>(max_dims))
      fail(where, ": shape ", shape_text(sh), " has more than ", max_dims, " dimensions");
    std::uint64_t numel = 1;
    bool overflow = false;
    for (const json& d : sh) {
      std::uint64_t x = as_count(d, where, "shape");
      if (x > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        fail(where, ": extent ", x, " in shape ", shape_text(sh), " is too large");
      e.sizes.push_back(static_cast<std::int64_t>(x));
      if (x != 0 && numel > std::numeric_limits<std::uint64_t>::max() / 8 / x) overflow = true;
      numel *= x;
    }
    e.begin = as_count(v["data_offsets"][0], where, "data_offsets");
    e.end = as_count(v["data_offsets"][1], where, "data_offsets");
    if (e.end < e.begin)
      fail(where, ": data_offsets [", e.begin, ", ", e.end, "] end before they begin");
    if (overflow || e.end - e.begin != numel * dtype_size(e.type))
      fail(where, ": data_offsets [", e.begin, ", ", e.end, "] span ", e.end - e.begin,
           " bytes but shape ", shape_text(sh), " of ", dt, " needs ",
           overflow ? std::string("an absurd number of")
                    : std::to_string(numel * dtype_size(e.type)));
    if (e.end > data_bytes)
      fail(where, ": data_offsets [", e.begin, ", ", e.end, "] lie outside the data section (",
           data_bytes, " bytes): the file is truncated or the header is wrong");
    e.data = data + e.begin;
    entries_.push_back(std::move(e));
  }

  // The spans must tile the data section: no overlaps, no holes, nothing after the last one.
  std::sort(entries_.begin(), entries_.end(), [](const auto& a, const auto& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  std::uint64_t pos = 0;
  for (std::size_t i = 0; i < entries_.size(); ++i) {
    const auto& e = entries_[i];
    if (e.begin < pos)
      fail(file, ", tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
           "] overlap tensor '", entries_[i - 1].name, "' (which ends at ", pos, ")");
    if (e.begin > pos)
      fail(file, ", tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
           "] leave a hole of ", e.begin - pos, " bytes before it in the data section");
    pos = e.end;
  }
  if (pos != data_bytes)
    fail(file, ": the tensors cover ", pos, " bytes but the data section has ", data_bytes,
         " (trailing bytes after the last tensor)");
  for (std::size_t i = 0; i < entries_.size(); ++i) index_[entries_[i].name] = i;
}

void read_into(const safetensors_entry& e, const tensor& dst, bool transpose) {
  owned_tensor aligned_copy;
  tensor src;
  if (e.aligned()) {
    src = e.view();
  } else {  // another writer's offsets: copy the bytes to aligned memory first
    aligned_copy = empty(e.sizes, e.type);
    std::memcpy(aligned_copy.data(), e.data, e.nbytes());
    src = aligned_copy;
  }
  if (transpose) src = src.transpose(0, 1);
  if (dst.is_cpu()) {
    ops::copy(src, dst);
    return;
  }
  owned_tensor host = empty(dst.sizes(), dst.type());
  ops::copy(src, host);
  TROUPE_CHECK(dst.is_contiguous(), "read_into: a device destination must be contiguous, got ",
               dst.describe());
  memory::copy_bytes(dst.data(), host.data(), host.nbytes(), memory::copy_kind::host_to_device);
}

// ---- writing --------------------------------------------------------------------------------

std::vector<tensor_spec> safetensors_writer::file_order(std::vector<tensor_spec> tensors) {
  std::stable_sort(tensors.begin(), tensors.end(), [](const tensor_spec& a, const tensor_spec& b) {
    std::size_t sa = dtype_size(a.type), sb = dtype_size(b.type);
    return sa != sb ? sa > sb : a.name < b.name;
  });
  return tensors;
}

safetensors_writer::safetensors_writer(const fs::path& path, std::vector<tensor_spec> tensors,
                                       const std::map<std::string, std::string>& metadata)
    : file_("safetensors file '" + path.string() + "'") {
  std::set<std::string_view> names;
  for (const auto& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__")
      fail(file_, ": invalid tensor name '", t.name, "'");
    if (!names.insert(t.name).second) fail(file_, ", tensor '", t.name, "': named twice");
  }
  order_ = file_order(std::move(tensors));

  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) {
    auto& m = header["__metadata__"];
    for (const auto& [k, v] : metadata) m[k] = v;
  }
  std::uint64_t offset = 0;
  for (const tensor_spec& t : order_) {
    const std::uint64_t bytes = static_cast<std::uint64_t>(t.sizes.numel()) * dtype_size(t.type);
    auto& e = header[t.name];
    e["dtype"] = safetensors_dtype_name(t.type);
    e["shape"] = nlohmann::ordered_json::array();
    for (auto d : t.sizes) e["shape"].push_back(d);
    e["data_offsets"] = {offset, offset + bytes};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  out_.emplace(path);
  unsigned char len[8];
  std::uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  out_->write(len, 8);
  out_->write(text);
}

void safetensors_writer::append(const tensor& part) {
  if (part.defined() && part.numel() == 0) return;  // nothing to write (an empty tensor's bytes)
  while (next_ < order_.size() && order_[next_].sizes.numel() == 0) ++next_;  // empty tensors
  if (next_ == order_.size()) fail(file_, ": more bytes than its tensors hold");
  const tensor_spec& t = order_[next_];
  if (!part.defined() || !part.is_cpu() || !part.is_contiguous() || part.type() != t.type ||
      done_ + part.numel() > t.sizes.numel())
    fail(file_, ", tensor '", t.name, "': needs a contiguous host ", dtype_name(t.type),
         " part of at most ", t.sizes.numel() - done_, " elements, got ",
         part.defined() ? part.describe() : std::string("undefined"));
  out_->write(part.data(), part.nbytes());
  done_ += part.numel();
  if (done_ == t.sizes.numel()) {
    ++next_;
    done_ = 0;
  }
}

atomic_file safetensors_writer::finish() {
  while (next_ < order_.size() && order_[next_].sizes.numel() == 0) ++next_;
  if (next_ != order_.size())
    fail(file_, ": finished before tensor '", order_[next_].name, "' was written");
  out_->finish();
  return std::move(*out_);
}

atomic_file write_safetensors(const fs::path& path, const std::vector<named_tensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  const std::string file = "safetensors file '" + path.string() + "'";
  std::vector<tensor_spec> specs;
  std::map<std::string_view, const named_tensor*> by_name;
  for (const auto& t : tensors) {
    if (!t.value.defined() || !t.value.is_cpu() || !t.value.is_contiguous())
      fail(file, ", tensor '", t.name, "': needs a defined contiguous host tensor, got ",
           t.value.defined() ? t.value.describe() : std::string("undefined"));
    specs.push_back({t.name, t.value.type(), t.value.sizes()});
    by_name[t.name] = &t;
  }
  safetensors_writer w(path, std::move(specs), metadata);
  for (const auto& spec : w.order()) w.append(by_name.at(spec.name)->value);
  return w.finish();
}

expected<std::uint64_t> save_safetensors(const fs::path& path,
                                         const std::vector<named_tensor>& tensors,
                                         const std::map<std::string, std::string>& metadata) {
  return as_expected([&] {
    atomic_file f = write_safetensors(path, tensors, metadata);
    f.commit();
    return f.bytes_written();
  });
}

}  // namespace troupe::models::hf
