// safetensors: reading and writing Hugging Face's tensor file format.
//
// A file is an 8-byte little-endian header length N, N bytes of JSON, then the data section:
//
//   {"__metadata__": {"format": "pt"},
//    "wte.weight": {"dtype": "F32", "shape": [256, 64], "data_offsets": [0, 65536]}, ...}
//
// Offsets are relative to the data section. Reading maps the file and validates everything
// before a single tensor is used: the header length, the JSON, every dtype and shape, that each
// tensor's byte span matches its shape, lies inside the data section and overlaps no other, and
// that the spans cover the data section without holes (as the format requires). Errors name the
// file and the tensor at fault.
//
// Writing follows HF: tensors sorted by element size (largest first) then name, so every tensor is
// aligned to its element size; the header padded with spaces to a multiple of 8 bytes; and the file
// written atomically (file_io.hpp: a crash never leaves a half file).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "memory/error.hpp"
#include "models/hf/file_io.hpp"
#include "tensor/dtype.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::hf {

// "F32", "BF16", "F16", "F64", "I32", "I64", "U8" <-> troupe dtypes.
std::string_view safetensors_dtype_name(dtype t);
std::optional<dtype> parse_safetensors_dtype(std::string_view name);

// One tensor of an open file: a view of its bytes inside the mapping.
struct safetensors_entry {
  std::string name;
  dtype type = dtype::f32;
  shape sizes;
  std::uint64_t begin = 0, end = 0;  // data_offsets, relative to the data section
  const std::byte* data = nullptr;   // the first byte (valid while the file is open)
  std::size_t nbytes() const { return static_cast<std::size_t>(end - begin); }
  bool aligned() const;  // data is aligned to the element size
  // A read-only host tensor over the mapped bytes (never write through it). Needs aligned().
  tensor view() const;
};

// An open, validated safetensors file. Move-only; the entries' bytes live as long as it does.
class safetensors_file {
 public:
  static expected<safetensors_file> open(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  // All tensors, in the order of their bytes in the file.
  const std::vector<safetensors_entry>& tensors() const { return entries_; }
  const safetensors_entry* find(std::string_view name) const;  // nullptr when absent
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  std::size_t file_size() const { return map_.size(); }

 private:
  safetensors_file() = default;
  void parse();  // throws troupe::error

  std::filesystem::path path_;
  mapped_file map_;
  std::vector<safetensors_entry> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// Copies a tensor of a file into `dst` (same shape, or the transposed shape of a 2-D tensor when
// `transpose`), converting between floating dtypes; dst may live on any device. Throws.
void read_into(const safetensors_entry& e, const tensor& dst, bool transpose = false);

// A named host tensor to write (contiguous, on the cpu; written in its own dtype).
struct named_tensor {
  std::string name;
  tensor value;
};

// What a writer is told about a tensor before its bytes.
struct tensor_spec {
  std::string name;
  dtype type = dtype::f32;
  shape sizes;
};

// A safetensors file written tensor by tensor (or in parts of a tensor), for writers that never
// hold all the tensors at once: the header is planned and written first (HF's order, exactly as
// write_safetensors lays it out), then the bytes come through append() in order() - parts of one
// tensor after another - into `<path>.tmp`; finish() checks every byte came and returns the file
// to commit. Throws troupe::error naming the file and the tensor.
class safetensors_writer {
 public:
  safetensors_writer(const std::filesystem::path& path, std::vector<tensor_spec> tensors,
                     const std::map<std::string, std::string>& metadata = {});
  const std::vector<tensor_spec>& order() const { return order_; }
  // The order a writer of `tensors` puts them in (by element size, largest first, then name).
  static std::vector<tensor_spec> file_order(std::vector<tensor_spec> tensors);
  void append(const tensor& part);  // contiguous host, the dtype of the tensor being written
  atomic_file finish();

 private:
  std::string file_;  // for messages
  std::vector<tensor_spec> order_;
  std::optional<atomic_file> out_;
  std::size_t next_ = 0;   // the tensor being written
  std::int64_t done_ = 0;  // its elements written
};

// Writes `tensors` to path atomically; returns the file's size in bytes.
expected<std::uint64_t> save_safetensors(const std::filesystem::path& path,
                                         const std::vector<named_tensor>& tensors,
                                         const std::map<std::string, std::string>& metadata = {});

// The same, but stops before the rename: the caller commits (or drops) the returned file. For
// writers of several files that commit them together. Throws troupe::error.
atomic_file write_safetensors(const std::filesystem::path& path,
                              const std::vector<named_tensor>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

}  // namespace troupe::models::hf
