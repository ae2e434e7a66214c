// reshard (see reshard.hpp): per-parameter views into flat buffers, matched by name.
#include "models/parallel/reshard.hpp"

#include <map>
#include <string>

#include "memory/error.hpp"
#include "models/parallel/parallelize_gpt.hpp"

namespace troupe::models::parallel {
namespace {

// The view of `flat` (laid out like `base`) where `field` lives in `base`.
tensor same_place(const tensor& field, const tensor& base, const tensor& flat) {
  const auto off = offset_in(field, base);
  TROUPE_CHECK(flat.numel() >= base.numel() && flat.type() == base.type(), "reshard: buffer ",
               flat.describe(), " is not laid out like ", base.describe());
  return flat.narrow(0, off, field.numel()).reshape(field.sizes());
}

// For every parameter of the piece (those it owns when owned_only), its view in `pflat` and the
// whole parameter's view in `wflat`, copied by copy_gpt_slice (into_piece: whole -> piece).
void move_parts(const whole_layout& w, const tensor& wflat, const piece_layout& p,
                const tensor& pflat, bool owned_only, bool into_piece) {
  TROUPE_CHECK(w.slots != nullptr && p.slots != nullptr, "reshard: a layout has no slot list");
  std::map<std::string, const tensor_slot*> by_name;
  for (const auto& s : w.slots->slots())
    if (s.kind == slot_kind::param) by_name[s.name] = &s;
  for (const auto& s : p.slots->slots()) {
    if (s.kind != slot_kind::param) continue;
    if (owned_only && p.owns && !p.owns(s.name)) continue;
    auto it = by_name.find(s.name);
    TROUPE_CHECK(it != by_name.end(), "reshard: the whole model has no parameter '", s.name, "'");
    copy_gpt_slice(s.name, same_place(*it->second->field, w.base, wflat),
                   same_place(*s.field, p.base, pflat), p.n_head, p.tp_rank, p.tp, into_piece,
                   "reshard");
  }
}

}  // namespace

std::int64_t offset_in(const tensor& field, const tensor& base) {
  auto off = (static_cast<const char*>(field.data()) - static_cast<const char*>(base.data())) /
             static_cast<std::ptrdiff_t>(base.element_size());
  TROUPE_CHECK(off >= 0 && off + field.numel() <= base.numel(), "reshard: a parameter (",
               field.describe(), ") lies outside its flat buffer ", base.describe());
  return off;
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
