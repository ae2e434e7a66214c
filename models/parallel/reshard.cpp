// reshard (see reshard.hpp): per-parameter views into flat buffers, matched by name.
#include "models/parallel/reshard.hpp"

#include <map>
#include <string>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {
namespace {

// The view of `flat` (laid out like `base`) where `field` lives in `base`.
tensor same_place(const tensor& field, const tensor& base, const tensor& flat) {
  auto off = (static_cast<const char*>(field.data()) - static_cast<const char*>(base.data())) /
             static_cast<std::ptrdiff_t>(base.element_size());
  TROUPE_CHECK(off >= 0 && off + field.numel() <= base.numel(), "reshard: a parameter (",
               field.describe(), ") lies outside its flat buffer ", base.describe());
  TROUPE_CHECK(flat.numel() >= base.numel() && flat.type() == base.type(), "reshard: buffer ",
               flat.describe(), " is not laid out like ", base.describe());
  return flat.narrow(0, off, field.numel()).reshape(field.sizes());
}

enum class rule { whole, qkv, dim0, dim1 };

rule rule_for(const std::string& name, const shape& ws, const shape& ps, const piece_layout& p) {
  const bool qkv = name.find("qkv_proj.") != std::string::npos;
  const int n = p.tp;
  if (ws == ps && !(qkv && n > 1)) return rule::whole;
  if (qkv && n > 1) return rule::qkv;
  if (ws.rank() == ps.rank() && ws[0] == ps[0] * n && (ws.rank() == 1 || ws[1] == ps[1]))
    return rule::dim0;
  if (ws.rank() == 2 && ps.rank() == 2 && ws[0] == ps[0] && ws[1] == ps[1] * n) return rule::dim1;
  TROUPE_FAIL("reshard: parameter '", name, "' is ", ps.str(), " on tensor shard ", p.tp_rank,
              " of ", n, " but ", ws.str(), " in the whole model: no slicing matches");
}

// The rows of the whole fused qkv parameter that this shard holds, as (whole row, piece row,
// count) runs: its q heads, then its k heads, then its v heads.
template <class F>
void qkv_runs(const piece_layout& p, F f) {
  const std::int64_t hq = p.n_head, hkv = p.n_kv_head > 0 ? p.n_kv_head : p.n_head, d = p.head_dim;
  TROUPE_CHECK(hq % p.tp == 0 && hkv % p.tp == 0 && d > 0, "reshard: ", hq, " query and ", hkv,
               " kv heads do not split over tp ", p.tp);
  const std::int64_t lq = hq / p.tp, lkv = hkv / p.tp;
  f(p.tp_rank * lq * d, 0, lq * d);
  f((hq + p.tp_rank * lkv) * d, lq * d, lkv * d);
  f((hq + hkv + p.tp_rank * lkv) * d, (lq + lkv) * d, lkv * d);
}

// Calls f(whole view, piece view) for every matching pair of parts.
template <class F>
void for_each_part(const whole_layout& w, const tensor& wflat, const piece_layout& p,
                   const tensor& pflat, bool owned_only, F f) {
  TROUPE_CHECK(w.slots != nullptr && p.slots != nullptr, "reshard: a layout has no slot list");
  std::map<std::string, const tensor_slot*> by_name;
  for (const auto& s : w.slots->slots())
    if (s.kind == slot_kind::param) by_name[s.name] = &s;
  for (const auto& s : p.slots->slots()) {
    if (s.kind != slot_kind::param) continue;
    if (owned_only && p.owns && !p.owns(s.name)) continue;
    auto it = by_name.find(s.name);
    TROUPE_CHECK(it != by_name.end(), "reshard: the whole model has no parameter '", s.name, "'");
    tensor wv = same_place(*it->second->field, w.base, wflat);
    tensor pv = same_place(*s.field, p.base, pflat);
    switch (rule_for(s.name, wv.sizes(), pv.sizes(), p)) {
      case rule::whole:
        f(wv, pv);
        break;
      case rule::qkv:
        qkv_runs(p, [&](std::int64_t wr, std::int64_t pr, std::int64_t rows) {
          f(wv.narrow(0, wr, rows), pv.narrow(0, pr, rows));
        });
        break;
      case rule::dim0: {
        std::int64_t len = pv.size(0);
        f(wv.narrow(0, p.tp_rank * len, len), pv);
        break;
      }
      case rule::dim1: {
        std::int64_t len = pv.size(1);
        f(wv.narrow(1, p.tp_rank * len, len), pv);
        break;
      }
    }
  }
}

}  // namespace

void scatter_to_piece(const whole_layout& whole, const tensor& from, const piece_layout& piece,
                      const tensor& to) {
  for_each_part(whole, from, piece, to, false,
                [](const tensor& w, const tensor& p) { ops::copy(w, p); });
}

void gather_from_piece(const piece_layout& piece, const tensor& from, const whole_layout& whole,
                       const tensor& to) {
  for_each_part(whole, to, piece, from, true,
                [](const tensor& w, const tensor& p) { ops::copy(p, w); });
}

}  // namespace troupe::models::parallel
