// reward_model: a scalar head on the trunk in HF's sequence-classification layout
// (reward_model.hpp).
#include "models/post/reward_model.hpp"

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>

#include "models/hf/file_io.hpp"
#include "models/hf/name_map.hpp"
#include "models/hf/safetensors.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {
namespace {

std::int64_t vocab_of(const hf::model_config& c) {
  return std::visit([](const auto& x) { return static_cast<std::int64_t>(x.vocab_size); }, c);
}

hf::model_config with_vocab(hf::model_config c, std::int64_t v) {
  std::visit([v](auto& x) { x.vocab_size = v; }, c);
  return c;
}

bool is_gpt2(const hf::model_config& c) {
  return std::holds_alternative<hf::gpt2_config>(c);
}

// Our parameter named `name` (throws naming it when absent).
const tensor& param(const slot_list& s, const std::string& name) {
  for (const tensor_slot& t : s.slots())
    if (t.kind == slot_kind::param && t.name == name) return *t.field;
  TROUPE_FAIL("reward model: no parameter ", name);
}

// The head's weight [V + 1, C] (lm_head, or the tied token embedding).
std::string head_name(const hf::model_config& c) {
  if (is_gpt2(c)) return "wte.weight";
  return std::get<hf::llama_config>(c).tie_word_embeddings ? "embed_tokens.weight"
                                                           : "lm_head.weight";
}

std::string embed_name(const hf::model_config& c) {
  return is_gpt2(c) ? "wte.weight" : "embed_tokens.weight";
}

template <class F>
void each_value(const tensor& x, std::int64_t i, F&& f) {
  if (x.type() == dtype::f32)
    f(x.data_as<float>()[i]);
  else
    f(x.data_as<double>()[i]);
}

}  // namespace

std::vector<std::int64_t> pooled_positions(const tensor& ids, std::int32_t pad_id) {
  TROUPE_CHECK(ids.defined() && ids.dim() == 2 && ids.type() == dtype::i32 && ids.is_cpu(),
               "reward model: ids must be host i32 [B, T], got ", describe(ids));
  const std::int64_t b = ids.size(0), t = ids.size(1);
  std::vector<std::int64_t> out(static_cast<std::size_t>(b));
  for (std::int64_t r = 0; r < b; ++r) {
    std::int64_t first = 0;  // torch's argmax of (ids == pad): the first pad, or 0 when none
    for (std::int64_t i = 0; i < t; ++i)
      if (ids.data_as<std::int32_t>()[r * t + i] == pad_id) {
        first = i;
        break;
      }
    out[static_cast<std::size_t>(r)] = r * t + ((first - 1) % t + t) % t;
  }
  return out;
}

reward_model::reward_model(const hf::model_config& cfg, batch_dims dims, std::int32_t pad_id,
                           dtype t)
    : cfg_(cfg), vocab_(vocab_of(cfg)), pad_(pad_id) {
  TROUPE_CHECK(!std::holds_alternative<hf::moe_config>(cfg),
               "reward model: GPT-2 and Llama configs only; a mixture-of-experts model has no "
               "sequence-classification layout here yet");
  TROUPE_CHECK(t == dtype::f32 || t == dtype::f64, "reward model: f32 or f64, got ", dtype_name(t));
  TROUPE_CHECK(pad_id >= 0 && pad_id < vocab_, "reward model: pad_token_id ", pad_id,
               " is not in the vocabulary of ", vocab_);
  lm_ = make_causal_lm(with_vocab(cfg, vocab_ + 1), dims, t);
}

std::vector<double> reward_model::forward(const tensor& ids) {
  targets_.assign(static_cast<std::size_t>(ids.numel()), -100);
  t_ = ids.size(1);
  lm_->forward(ids, tensor(targets_.data(), targets_.size() * 4, dtype::i32, ids.sizes()));
  pooled_ = pooled_positions(ids, pad_);
  const tensor logits = lm_->logits();  // [B * T, V + 1]
  std::vector<double> r(pooled_.size());
  for (std::size_t b = 0; b < r.size(); ++b)
    each_value(logits, pooled_[b] * (vocab_ + 1) + vocab_, [&](auto v) { r[b] = v; });
  return r;
}

void reward_model::backward(std::span<const double> drewards, double loss_scale) {
  TROUPE_CHECK(drewards.size() == pooled_.size(), "reward model: ", pooled_.size(), " rewards but ",
               drewards.size(), " gradients");
  const std::int64_t cols = vocab_ + 1, v = vocab_;
  const auto& pooled = pooled_;
  TROUPE_CHECK(lm_->set_logit_grads([&, cols, v](const tensor& dlogits, double dloss) {
    ops::fill(dlogits, 0.0);
    for (std::size_t b = 0; b < pooled.size(); ++b) {
      const std::int64_t i = pooled[b] * cols + v;
      if (dlogits.type() == dtype::f32)
        dlogits.data_as<float>()[i] = static_cast<float>(dloss * drewards[b]);
      else
        dlogits.data_as<double>()[i] = dloss * drewards[b];
    }
  }),
               "reward model: the model cannot take a score's gradient");
  lm_->backward(loss_scale);
  lm_->set_logit_grads({});
}

expected<std::filesystem::path> reward_model::save(const std::filesystem::path& folder) const {
  using result = expected<std::filesystem::path>;
  try {
    const hf::name_map map = hf::name_map_for(cfg_);
    const slot_list& slots = lm_->slots();
    std::vector<owned_tensor> keep;  // f32 copies in the file's layout
    std::vector<hf::named_tensor> out;
    auto add = [&](const std::string& name, const tensor& ours, bool transpose) {
      const tensor src = transpose ? ours.transpose(0, 1) : ours;
      owned_tensor f = empty(src.sizes(), dtype::f32);
      ops::copy(src, f);
      out.push_back({name, f.view()});
      keep.push_back(std::move(f));
    };
    for (const hf::name_map_entry& e : map.entries) {
      if (e.tied || e.hf_name == "lm_head.weight") continue;
      const tensor& p = param(slots, e.our_name);
      add(e.hf_name, e.our_name == embed_name(cfg_) ? p.narrow(0, 0, vocab_) : p, e.transpose);
    }
    add("score.weight", param(slots, head_name(cfg_)).narrow(0, vocab_, 1), false);
    auto written = hf::save_safetensors(folder / "model.safetensors", out, {{"format", "pt"}});
    if (!written) return result::failure(written.error_message());
    auto j = nlohmann::json::parse(hf::config_json(cfg_));
    j["architectures"] = {is_gpt2(cfg_) ? "GPT2ForSequenceClassification"
                                        : "LlamaForSequenceClassification"};
    j["num_labels"] = 1;
    j["id2label"] = {{"0", "LABEL_0"}};
    j["label2id"] = {{"LABEL_0", 0}};
    j["pad_token_id"] = pad_;
    hf::write_text_file_atomically(folder / "config.json", j.dump(2) + "\n");
    return folder;
  } catch (const error& e) {
    return result::failure(e.what());
  }
}

expected<std::filesystem::path> reward_model::load(const std::filesystem::path& folder,
                                                   bool need_score) {
  using result = expected<std::filesystem::path>;
  const auto path = folder / "model.safetensors";
  auto file = hf::safetensors_file::open(path);
  if (!file) return result::failure(file.error_message());
  try {
    const hf::name_map map = hf::name_map_for(cfg_);
    const slot_list& slots = lm_->slots();
    auto need = [&](const std::string& name) -> const hf::safetensors_entry& {
      const auto* e = file->find(name);
      if (e == nullptr && is_gpt2(cfg_)) e = file->find(name.substr(map.optional_prefix.size()));
      TROUPE_CHECK(e != nullptr, path.string(), ": no tensor ", name);
      return *e;
    };
    for (const hf::name_map_entry& e : map.entries) {
      if (e.tied || e.hf_name == "lm_head.weight") continue;
      const tensor& p = param(slots, e.our_name);
      hf::read_into(need(e.hf_name), e.our_name == embed_name(cfg_) ? p.narrow(0, 0, vocab_) : p,
                    e.transpose);
    }
    if (need_score || file->find("score.weight") != nullptr)
      hf::read_into(need("score.weight"), param(slots, head_name(cfg_)).narrow(0, vocab_, 1));
  } catch (const error& e) {
    return result::failure(e.what());
  }
  return folder;
}

}  // namespace troupe::models
