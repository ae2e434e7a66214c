// checkpoint: loading and saving a model's parameters as an HF model folder.
//
// A folder holds `config.json` and either `model.safetensors` or shards
// `model-00001-of-0000N.safetensors` with `model.safetensors.index.json` (whose "weight_map" names
// the shard of every tensor). Loading is generic over a name_map (name_map.hpp) and fills the
// parameter slots of a model's slot_list, whatever their dtype (f32 or f64) and device: tensors
// are read from the mapped file, converted from F32/BF16/F16/F64 and transposed where the map
// says, on the host, then copied to the parameter. Before anything is written into the model the
// whole folder is checked: every tensor of the map present (tied ones excepted), no tensor the
// map does not know (buffers the map lists as ignorable excepted), shapes as the config implies,
// the index and its shards consistent. Errors name the file and the tensor.
//
// Saving writes F32 (or BF16/F16), one file or shards of at most max_shard_bytes, never the tied
// tensors, with HF's names and layouts; every file is written to `<name>.tmp`, synced and renamed
// (shards all finished before any is renamed, the index last), and weight files of an earlier
// save that the new one does not use are removed. Typical use:
//
//   auto cfg = hf::read_config(folder).value();             // -> build the model from it
//   hf::load_weights(folder, cfg, model.slots()).value();
//   hf::save_checkpoint(out, cfg, model.slots(), {.weights = dtype::bf16}).value();
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <vector>

#include "memory/error.hpp"
#include "models/hf/config.hpp"
#include "models/hf/name_map.hpp"
#include "models/hf/safetensors.hpp"
#include "models/layers/slots.hpp"
#include "tensor/dtype.hpp"

namespace troupe::models::hf {

struct save_options {
  dtype weights = dtype::f32;  // dtype on disk: f32, bf16, f16 (or f64)
  // 0: one model.safetensors. Otherwise shards holding at most this many tensor bytes each (a
  // tensor larger than the limit gets a shard of its own), plus model.safetensors.index.json.
  std::uint64_t max_shard_bytes = 0;
};

// Loads the weights of `folder` into the parameter slots (bound by a layer_memory). Returns the
// weight files read.
expected<std::vector<std::filesystem::path>> load_weights(const std::filesystem::path& folder,
                                                          const name_map& map,
                                                          const slot_list& slots);
expected<std::vector<std::filesystem::path>> load_weights(const std::filesystem::path& folder,
                                                          const model_config& cfg,
                                                          const slot_list& slots);

// load_weights without the model's memory: checks the folder against the map and the parameter
// slots' names and shapes exactly as load_weights does (bound: that the slots have memory too),
// then hands every tensor of the map to `each` with its entry in the mapped file (valid during the
// call; read_into(file_entry, dst, entry.transpose) reads it in our layout). Returns the files.
using weight_reader =
    std::function<void(const name_map_entry& entry, const safetensors_entry& file_entry)>;
expected<std::vector<std::filesystem::path>> read_weights(const std::filesystem::path& folder,
                                                          const name_map& map,
                                                          const slot_list& slots,
                                                          const weight_reader& each,
                                                          bool bound = false);

// Writes the weight files of the parameter slots into `folder` (which must exist). Returns the
// files written (shards, then the index).
expected<std::vector<std::filesystem::path>> save_weights(const std::filesystem::path& folder,
                                                          const name_map& map,
                                                          const slot_list& slots,
                                                          const save_options& opt = {});

// Creates `folder` if needed and writes the weights, then config.json. Returns the files written.
expected<std::vector<std::filesystem::path>> save_checkpoint(const std::filesystem::path& folder,
                                                             const model_config& cfg,
                                                             const slot_list& slots,
                                                             const save_options& opt = {});

// save_checkpoint's files (one model.safetensors in f32, then config.json) written one tensor at a
// time, for callers that never hold the whole model (models/parallel's pieces): write() takes the
// tensors of order() in that order, each in our layout; commit() renames the weights into place
// and writes config.json. The bytes equal save_checkpoint's. Throws troupe::error.
class checkpoint_writer {
 public:
  checkpoint_writer(const std::filesystem::path& folder, const model_config& cfg);  // folder exists
  // The non-tied tensors of the config's name map, in the order their bytes lie in the file.
  static std::vector<name_map_entry> order(const model_config& cfg);
  // The next tensor of order(): f32 host, our shape (the transpose of the file's where it says).
  void write(const tensor& ours);
  std::vector<std::filesystem::path> commit();

 private:
  std::filesystem::path folder_;
  model_config cfg_;
  std::vector<name_map_entry> order_;
  std::size_t next_ = 0;
  safetensors_writer file_;
  owned_tensor out_;  // the file's layout of the tensor being written
};

// Writes a checkpoint folder as one unit: write(staging) fills `<folder>.partial` (created empty:
// stage_folder in file_io.hpp; its files must be committed, i.e. synced, as atomic_file does);
// only when it succeeds does the new folder replace `folder` (publish_folder: one synced swap,
// then the previous one is removed). A failed write (a full disk, an I/O error) leaves `folder`
// exactly as it was and removes the partial one; the error says so (and the step the folder
// holds). A `folder` that is neither empty nor a troupe checkpoint is refused before anything is
// written, naming it and its files (checkpoint_folder.hpp). Returns `folder`.
expected<std::filesystem::path> save_folder_atomically(
    const std::filesystem::path& folder,
    const std::function<expected<std::filesystem::path>(const std::filesystem::path& staging)>&
        write);

// The shard file name HF uses: "model-00002-of-00005.safetensors".
std::string shard_file_name(int index, int count);

}  // namespace troupe::models::hf
