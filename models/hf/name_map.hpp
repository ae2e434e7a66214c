// name_map: how HF checkpoint tensor names and layouts correspond to a model's parameter slots.
//
// A name map is data: one entry per HF tensor, with the name of our parameter, the shape the
// config implies for the tensor in the file, and whether the file's layout is the transpose of
// ours (GPT-2's Conv1D keeps weights [in, out]; our linear layers keep [out, in]). A tied tensor
// (GPT-2's lm_head.weight, the same bytes as the token embedding) is never written and, when a
// file has it anyway, is ignored. Some files drop a name prefix (GPT-2 files without
// "transformer."), and some carry buffers that are not parameters (GPT-2's attn.bias causal masks,
// Llama's rotary_emb.inv_freq): the map lists both, so loading accepts them.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "models/hf/config.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::hf {

struct name_map_entry {
  std::string hf_name;   // e.g. "transformer.h.0.attn.c_attn.weight"
  std::string our_name;  // e.g. "h.0.attn.qkv_proj.weight" (for a tied entry: the tensor it shares)
  shape hf_shape;        // the shape in the file, from the config
  bool transpose = false;  // file [in, out] <-> ours [out, in] (2-D only)
  bool tied = false;       // absent from the file: it shares our_name's bytes
};

struct name_map {
  std::vector<name_map_entry> entries;
  // A prefix that files may leave out of every name ("transformer." for GPT-2).
  std::string optional_prefix;
  // Name suffixes of non-parameter buffers a file may carry; they are skipped on load.
  std::vector<std::string> ignorable_suffixes;

  const name_map_entry* find_hf(std::string_view hf_name) const;  // nullptr when absent
  // The entry of a name as found in a file (trying the optional prefix), or nullptr.
  const name_map_entry* match(std::string_view file_name) const;
  bool ignorable(std::string_view file_name) const;
};

// GPT2LMHeadModel <-> models/gpt.hpp (wte.weight, h.{i}.attn.qkv_proj.weight, ...).
name_map gpt2_name_map(const gpt2_config& c);
// LlamaForCausalLM <-> the Llama model's names (HF's without "model.", plus lm_head.weight).
name_map llama_name_map(const llama_config& c);
// MixtralForCausalLM / Qwen2MoeForCausalLM <-> models/moe.hpp: Qwen2-MoE's names without
// "model." (layers.{i}.mlp.experts.{e}.gate_proj.weight, ...); Mixtral's
// block_sparse_moe.experts.{e}.w1 / w3 / w2 map to mlp.experts.{e}.gate_proj / up_proj / down_proj.
name_map moe_name_map(const moe_config& c);
// The map of any config.
name_map name_map_for(const model_config& c);

}  // namespace troupe::models::hf
