// The GPT-2, Llama and MoE (Mixtral, Qwen2-MoE) name maps (see name_map.hpp).
#include "models/hf/name_map.hpp"

namespace troupe::models::hf {

const name_map_entry* name_map::find_hf(std::string_view hf_name) const {
  for (const auto& e : entries)
    if (e.hf_name == hf_name) return &e;
  return nullptr;
}

const name_map_entry* name_map::match(std::string_view file_name) const {
  if (const auto* e = find_hf(file_name)) return e;
  if (!optional_prefix.empty() && !file_name.starts_with(optional_prefix))
    return find_hf(optional_prefix + std::string(file_name));
  return nullptr;
}

bool name_map::ignorable(std::string_view file_name) const {
  for (const auto& s : ignorable_suffixes)
    if (file_name.ends_with(s)) return true;
  return false;
}

name_map gpt2_name_map(const gpt2_config& c) {
  const std::int64_t d = c.n_embd, v = c.vocab_size, f = c.n_inner();
  name_map m;
  m.optional_prefix = "transformer.";
  m.ignorable_suffixes = {".attn.bias", ".attn.masked_bias"};
  auto add = [&](std::string hf, std::string ours, shape s, bool transpose = false) {
    m.entries.push_back({"transformer." + hf, std::move(ours), s, transpose, false});
  };
  add("wte.weight", "wte.weight", {v, d});
  add("wpe.weight", "wpe.weight", {c.n_positions, d});
  for (std::int64_t i = 0; i < c.n_layer; ++i) {
    const std::string h = "h." + std::to_string(i) + ".";
    for (const char* ln : {"ln_1", "ln_2"}) {
      add(h + ln + ".weight", h + ln + ".weight", {d});
      add(h + ln + ".bias", h + ln + ".bias", {d});
    }
    add(h + "attn.c_attn.weight", h + "attn.qkv_proj.weight", {d, 3 * d}, true);
    add(h + "attn.c_attn.bias", h + "attn.qkv_proj.bias", {3 * d});
    add(h + "attn.c_proj.weight", h + "attn.o_proj.weight", {d, d}, true);
    add(h + "attn.c_proj.bias", h + "attn.o_proj.bias", {d});
    add(h + "mlp.c_fc.weight", h + "mlp.fc.weight", {d, f}, true);
    add(h + "mlp.c_fc.bias", h + "mlp.fc.bias", {f});
    add(h + "mlp.c_proj.weight", h + "mlp.proj.weight", {f, d}, true);
    add(h + "mlp.c_proj.bias", h + "mlp.proj.bias", {d});
  }
  add("ln_f.weight", "ln_f.weight", {d});
  add("ln_f.bias", "ln_f.bias", {d});
  m.entries.push_back({"lm_head.weight", "wte.weight", {v, d}, false, true});
  return m;
}

name_map llama_name_map(const llama_config& c) {
  const std::int64_t h = c.hidden_size, v = c.vocab_size, ff = c.intermediate_size;
  const std::int64_t q = c.num_attention_heads * c.head_dim;
  const std::int64_t kv = c.num_key_value_heads * c.head_dim;
  name_map m;
  m.ignorable_suffixes = {".rotary_emb.inv_freq"};
  auto add = [&](const std::string& ours, shape s) {
    m.entries.push_back({"model." + ours, ours, s, false, false});
  };
  add("embed_tokens.weight", {v, h});
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    add(l + "input_layernorm.weight", {h});
    const struct {
      const char* name;
      std::int64_t out, in;
    } projections[] = {{"q_proj", q, h}, {"k_proj", kv, h}, {"v_proj", kv, h}, {"o_proj", h, q}};
    for (const auto& p : projections) {
      add(l + "self_attn." + p.name + ".weight", {p.out, p.in});
      if (c.attention_bias) add(l + "self_attn." + p.name + ".bias", {p.out});
    }
    add(l + "post_attention_layernorm.weight", {h});
    add(l + "mlp.gate_proj.weight", {ff, h});
    if (c.mlp_bias) add(l + "mlp.gate_proj.bias", {ff});
    add(l + "mlp.up_proj.weight", {ff, h});
    if (c.mlp_bias) add(l + "mlp.up_proj.bias", {ff});
    add(l + "mlp.down_proj.weight", {h, ff});
    if (c.mlp_bias) add(l + "mlp.down_proj.bias", {h});
  }
  add("norm.weight", {h});
  if (c.tie_word_embeddings)
    m.entries.push_back({"lm_head.weight", "embed_tokens.weight", {v, h}, false, true});
  else
    m.entries.push_back({"lm_head.weight", "lm_head.weight", {v, h}, false, false});
  return m;
}

name_map moe_name_map(const moe_config& c) {
  const std::int64_t h = c.hidden_size, v = c.vocab_size, ff = c.expert_size();
  const std::int64_t hd = c.hidden_size / c.num_attention_heads;
  const std::int64_t q = c.num_attention_heads * hd, kv = c.num_key_value_heads * hd;
  const bool qwen = c.qwen2_moe();
  name_map m;
  m.ignorable_suffixes = {".rotary_emb.inv_freq"};
  auto add = [&](const std::string& hf, const std::string& ours, shape s) {
    m.entries.push_back({"model." + hf, ours, s, false, false});
  };
  add("embed_tokens.weight", "embed_tokens.weight", {v, h});
  for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) {
    const std::string l = "layers." + std::to_string(i) + ".";
    add(l + "input_layernorm.weight", l + "input_layernorm.weight", {h});
    const struct {
      const char* name;
      std::int64_t out, in;
    } projections[] = {{"q_proj", q, h}, {"k_proj", kv, h}, {"v_proj", kv, h}, {"o_proj", h, q}};
    for (const auto& p : projections) {
      const std::string a = l + "self_attn." + p.name;
      add(a + ".weight", a + ".weight", {p.out, p.in});
      if (qwen && std::string_view(p.name) != "o_proj") add(a + ".bias", a + ".bias", {p.out});
    }
    add(l + "post_attention_layernorm.weight", l + "post_attention_layernorm.weight", {h});
    const std::string ours = l + "mlp.";
    const std::string theirs = l + (qwen ? "mlp." : "block_sparse_moe.");
    add(theirs + "gate.weight", ours + "gate.weight", {c.num_experts, h});
    for (std::int64_t e = 0; e < c.num_experts; ++e) {
      const std::string x = "experts." + std::to_string(e) + ".";
      // Mixtral's w1, w3, w2 are gate_proj, up_proj, down_proj.
      add(theirs + x + (qwen ? "gate_proj" : "w1") + ".weight", ours + x + "gate_proj.weight",
          {ff, h});
      add(theirs + x + (qwen ? "up_proj" : "w3") + ".weight", ours + x + "up_proj.weight", {ff, h});
      add(theirs + x + (qwen ? "down_proj" : "w2") + ".weight", ours + x + "down_proj.weight",
          {h, ff});
    }
    if (qwen) {
      const std::int64_t sh = c.shared_expert_intermediate_size;
      for (const char* p : {"gate_proj", "up_proj"})
        add(theirs + "shared_expert." + p + ".weight", ours + "shared_expert." + p + ".weight",
            {sh, h});
      add(theirs + "shared_expert.down_proj.weight", ours + "shared_expert.down_proj.weight",
          {h, sh});
      add(theirs + "shared_expert_gate.weight", ours + "shared_expert_gate.weight", {1, h});
    }
  }
  add("norm.weight", "norm.weight", {h});
  if (c.tie_word_embeddings)
    m.entries.push_back({"lm_head.weight", "embed_tokens.weight", {v, h}, false, true});
  else
    m.entries.push_back({"lm_head.weight", "lm_head.weight", {v, h}, false, false});
  return m;
}

name_map name_map_for(const model_config& c) {
  if (const auto* g = std::get_if<gpt2_config>(&c)) return gpt2_name_map(*g);
  if (const auto* m = std::get_if<moe_config>(&c)) return moe_name_map(*m);
  return llama_name_map(std::get<llama_config>(c));
}

}  // namespace troupe::models::hf
