// reshard (see reshard.hpp): per-parameter views into flat buffers, matched by name.
#include "models/parallel/reshard.hpp"

#include <map>
#include <string>

#include "memory/error.hpp"
#include "models/parallel/param_slices.hpp"

namespace troupe::models::parallel {
namespace {

// The view of `flat` (laid out like `base`) where `field` lives in `base`.
tensor same_place(const tensor& field, const tensor& base, const tensor& flat) {
  const auto off = offset_in(field, base);
  TROUPE_CHECK(flat.numel() >= base.numel() && flat.type() == base.type(), "reshard: buffer ",
               flat.describe(), " is not laid out like ", base.describe());
  return flat.narrow(0, off, field.numel()).reshape(field.sizes());
}

const tensor_slot* param_named(const slot_list& slots, std::string_view name) {
  for (const auto& s : slots.slots())
    if (s.kind == slot_kind::param && s.name == name) return &s;
  return nullptr;
}

// Whole parameter `full` <-> the piece's parameter `s` (its view in `pflat`) by copy_slice.
void move_one(const tensor_slot& s, const tensor& full, const piece_layout& p, const tensor& pflat,
              bool into_piece) {
  copy_slice(s, full, same_place(*s.field, p.base, pflat), p.tp_rank, p.tp, into_piece, "reshard");
}

// For every parameter of the piece (those it owns when owned_only), its view in `pflat` and the
// whole parameter's view in `wflat`, copied by copy_slice (into_piece: whole -> piece).
void move_parts(const whole_layout& w, const tensor& wflat, const piece_layout& p,
                const tensor& pflat, bool owned_only, bool into_piece) {
  TROUPE_CHECK(p.slots != nullptr, "reshard: the piece's layout has no slot list");
  for (const auto& s : p.slots->slots()) {
    if (s.kind != slot_kind::param) continue;
    if (owned_only && p.owns && !p.owns(s)) continue;
    const whole_param* wp = w.find(s.name);
    TROUPE_CHECK(wp != nullptr, "reshard: the whole model has no parameter '", s.name, "'");
    move_one(s, w.view(wflat, *wp), p, pflat, into_piece);
  }
}

}  // namespace

whole_layout whole_layout::of(const slot_list& slots) {
  const auto placed = place_params(slots, dtype::f32);
  whole_layout w;
  w.numel = placed.numel;
  std::size_t k = 0;
  for (const auto& s : slots.slots())
    if (s.kind == slot_kind::param) w.params.push_back({s.name, s.sizes, placed.offsets[k++]});
  return w;
}

const whole_param* whole_layout::find(std::string_view name) const {
  for (const auto& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

tensor whole_layout::view(const tensor& flat, const whole_param& p) const {
  TROUPE_CHECK(flat.dim() == 1 && flat.numel() >= numel, "reshard: buffer ", flat.describe(),
               " is not laid out like the whole model's ", numel, " parameter elements");
  return flat.narrow(0, p.offset, p.numel()).reshape(p.sizes);
}

std::int64_t offset_in(const tensor& field, const tensor& base) {
  auto off = (static_cast<const char*>(field.data()) - static_cast<const char*>(base.data())) /
             static_cast<std::ptrdiff_t>(base.element_size());
  TROUPE_CHECK(off >= 0 && off + field.numel() <= base.numel(), "reshard: a parameter (",
               field.describe(), ") lies outside its flat buffer ", base.describe());
  return off;
}

bool scatter_param(std::string_view name, const tensor& full, const piece_layout& piece,
                   const tensor& to) {
  TROUPE_CHECK(piece.slots != nullptr, "reshard: the piece's layout has no slot list");
  const tensor_slot* s = param_named(*piece.slots, name);
  if (s == nullptr) return false;
  move_one(*s, full, piece, to, true);
  return true;
}

bool gather_param(const piece_layout& piece, const tensor& from, std::string_view name,
                  const tensor& full) {
  TROUPE_CHECK(piece.slots != nullptr, "reshard: the piece's layout has no slot list");
  const tensor_slot* s = param_named(*piece.slots, name);
  if (s == nullptr || (piece.owns && !piece.owns(*s))) return false;
  move_one(*s, full, piece, from, false);
  return true;
}

void scatter_to_piece(const whole_layout& whole, const tensor& from, const piece_layout& piece,
                      const tensor& to) {
  move_parts(whole, from, piece, to, false, true);
}

void gather_from_piece(const piece_layout& piece, const tensor& from, const whole_layout& whole,
                       const tensor& to) {
  move_parts(whole, to, piece, from, true, false);
}

}  // namespace troupe::models::parallel
