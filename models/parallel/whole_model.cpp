// whole_model (see whole_model.hpp): an unbound model as the whole model's description.
#include "models/parallel/whole_model.hpp"

#include <exception>
#include <set>
#include <string>

#include "memory/error.hpp"
#include "models/causal_lm.hpp"
#include "models/families.hpp"
#include "models/gpt.hpp"
#include "models/hf/checkpoint.hpp"
#include "models/hf/file_io.hpp"
#include "models/llama.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

whole_model::whole_model(const hf::model_config& model) : config_(model) {
  const batch_dims one{1, 1};  // declared activations only: an unbound model binds nothing
  with_family(model, [&](auto family, auto c) {
    using model_type = typename decltype(family)::type::model;
    c.unbound = true;
    auto m = std::make_shared<const model_type>(c, one);
    slots_ = &m->slots();
    init_ = [w = m.get()](std::uint64_t seed, const init_sink& each) {
      w->init_values(seed, each);
    };
    model_ = std::move(m);
  });
  layout_ = whole_layout::of(slots());
}

whole_model::~whole_model() = default;

void whole_model::init_values(std::uint64_t seed, const init_sink& each) const {
  init_(seed, each);
}

namespace {

std::set<std::string, std::less<>> params_of(const piece_layout& piece, const char* what) {
  TROUPE_CHECK(piece.slots != nullptr, what, ": the piece's layout has no slot list");
  std::set<std::string, std::less<>> held;
  for (const auto& s : piece.slots->slots())
    if (s.kind == slot_kind::param) held.insert(s.name);
  return held;
}

}  // namespace

void init_piece(const whole_model& whole, std::uint64_t seed, const piece_layout& piece,
                const tensor& to) {
  const auto held = params_of(piece, "init_piece");
  whole.init_values(seed, [&](const tensor_slot& s, const tensor& values) {
    if (held.count(s.name) == 0) return;  // drawn all the same: the stream stays in step
    // As store_param rounds: f64 -> the f32 parameter, then the piece's slice of it.
    owned_tensor full = empty(s.sizes, dtype::f32);
    ops::copy(values, full);
    scatter_param(s.name, full, piece, to);
  });
}

void load_piece(const whole_model& whole, const std::filesystem::path& folder,
                const piece_layout& piece, const tensor& to) {
  const auto held = params_of(piece, "load_piece");
  const whole_layout& w = whole.layout();
  hf::read_weights(
      folder, hf::name_map_for(whole.config()), whole.slots(),
      [&](const hf::name_map_entry& e, const hf::safetensors_entry& t) {
        if (held.count(e.our_name) == 0) return;
        try {
          const whole_param* p = w.find(e.our_name);
          TROUPE_CHECK(p != nullptr, "the whole model has no parameter '", e.our_name, "'");
          owned_tensor full = empty(p->sizes, dtype::f32);
          hf::read_into(t, full, e.transpose);
          scatter_param(e.our_name, full, piece, to);
        } catch (const std::exception& err) {
          hf::fail("load_piece: '", folder.string(), "', tensor '", e.hf_name, "': ", err.what());
        }
      })
      .value();
}

}  // namespace troupe::models::parallel
